"""The planner's analytic step time of a candidate.

:func:`step_estimate`: the slowest replica's pipeline (:func:`medley.search.estimate.bounds.pipeline_time`
over its stages' F+B+W, its boundary transfers and streamed ZeRO-3 traffic) plus the
data-parallel work past the pipeline's end on the busiest link (gradient reductions past each
rank's tail bubble, ZeRO-1/2's weight gathers after the step, optimizer steps).
Only used to prune and order candidates; the simulator gives every reported figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from medley.cost import formulas
from medley.cost.interfaces import Collective
from medley.cost.zero_levels import zero_level
from medley.cost.zero_memory import state_bytes_per_param
from medley.lowering.collectives import OPTIMIZER_STEP_BYTES_PER_PARAM
from medley.lowering.tp_links import dp_bytes_factor
from medley.search.estimate.bounds import pipeline_time
from medley.search.estimate.context import PlanContext, Signatures
from medley.search.space import MemoryOption, Structure


def step_estimate(
    est: PlanContext,
    st: Structure,
    family: str,
    split: Sequence[int],
    options: Sequence[MemoryOption],
    micro_batches: Sequence[int],
    signatures: Signatures,
    virtual_stages: int = 1,
) -> float:
    """Estimated step seconds: slowest replica's pipeline plus the exposed DP work (:func:`exposed_dp`)."""
    mbs, pp = st.micro_batch_size, st.pp
    chain = len(split)
    starts = [0, *accumulate(split)]
    worst = 0.0
    rank_busy = 0.0
    stream = stream_times(est, st, family, split, options)
    stage_of_rank = [[s for s in range(chain) if s % pp == k] for k in range(pp)]
    for sig, members in signatures:
        row = st.assignment[members[0]]
        tables = [est.table(sig[k], mbs, tp=st.tp_of(k)) for k in range(pp)]
        # Streamed ZeRO-3 gathers mostly wait in line with the compute (the simulator shows
        # little overlap), so they are counted on top of it.
        times = [
            sum(tables[k].time(starts[s], starts[s + 1], recompute=options[s].recompute) + stream[s]
                for s in stage_of_rank[k])
            for k in range(pp)
        ]
        weights = [
            sum(tables[k].weight[starts[s + 1]] - tables[k].weight[starts[s]] for s in stage_of_rank[k])
            for k in range(pp)
        ]
        links = [est.boundary_time(row[k], row[k + 1], mbs, st.tp_of(k), st.tp_of(k + 1))
                 for k in range(pp - 1)]
        m = max(micro_batches[r] for r in members)
        worst = max(
            worst,
            pipeline_time(
                family,
                stage_times=times,
                stage_weight_times=weights,
                link_times=links,
                micro_batches=m,
                virtual_stages=virtual_stages,
                link_load=network_load(est, st) * virtual_stages,
            ),
        )
        rank_busy = max(rank_busy, max(times))
    return worst + exposed_dp(est, st, split, options, micro_batches, rank_busy)


def network_load(est: PlanContext, st: Structure) -> float:
    """Seconds per micro-batch the busiest node network port (each direction) is busy with the
    pipeline transfers: every replica's hops that leave a node, each TP rank's
    (:meth:`PlanContext.boundary_time`), activations forward and gradients back, each for as long
    as it takes on its path (a hop across a slow tier holds the port longer), as the
    simulator books them."""
    key = (st.assignment, st.tp, st.micro_batch_size)
    load = est.network_loads.get(key)
    if load is not None:
        return load
    ports: dict[tuple[str, str], float] = {}
    devices = est.cluster.devices
    mbs = st.micro_batch_size
    for row in st.assignment:
        for k in range(st.pp - 1):
            a, b = devices[row[k]].node, devices[row[k + 1]].node
            if a == b:
                continue
            forward = est.boundary_time(row[k], row[k + 1], mbs, st.tp_of(k), st.tp_of(k + 1))
            back = est.boundary_time(row[k + 1], row[k], mbs, st.tp_of(k + 1), st.tp_of(k))
            for port, busy in (((a, "tx"), forward), ((b, "rx"), forward), ((b, "tx"), back),
                               ((a, "rx"), back)):
                ports[port] = ports.get(port, 0.0) + busy
    load = est.network_loads[key] = max(ports.values(), default=0.0)
    return load


def stream_times(
    est: PlanContext, st: Structure, family: str, split: Sequence[int], options: Sequence[MemoryOption]
) -> list[float]:
    """Per stage, one micro-batch's streamed ZeRO-3 traffic: a gather per compute action
    (F and the backward, or F, B and W) and a reduce-scatter of the gradient."""
    out = []
    start = 0
    actions = 3 if family == "zb-h1" else 2
    groups = None
    for s, n in enumerate(split):
        if not options[s].streams or st.zero_dp == 1:
            out.append(0.0)
            start += n
            continue
        tp = st.tp_of(s % st.pp)
        params = float(formulas.stage_held_params(est.model, start, start + n, tp=tp)) \
            + formulas.stage_adapter_params(est.model, est.adapter, start, start + n, tp=tp)
        trained = formulas.stage_trained_params(est.model, est.adapter, start, start + n, tp=tp)
        start += n
        groups = groups or dp_groups(est, st)
        group, wire, _ = groups[s % st.pp]
        params, trained = params * wire, trained * wire  # the other TP ranks' groups share links
        gather = est.comm.collective_time(Collective.ALL_GATHER, group, params * 2.0)
        scatter = est.comm.collective_time(Collective.REDUCE_SCATTER, group, trained * 2.0)
        out.append(actions * gather + scatter)
    return out


def exposed_dp(
    est: PlanContext,
    st: Structure,
    split: Sequence[int],
    options: Sequence[MemoryOption],
    micro_batches: Sequence[int],
    stage_time: float,
) -> float:
    """The DP work past the pipeline's end, in the plan's dtype (:mod:`medley.cost.zero_levels`
    says which collective each level runs): per pipeline rank, its stages' gradient reductions
    (each starting at the rank's tail bubble), then their weight gathers after the step at
    ZeRO-1/2 (nothing runs behind them) and their optimizer steps. Collectives that share a link
    wait for each other, as in the simulator: a rank's stages share its devices' ports, and the
    ranks whose DP groups span nodes share each of those nodes' network ports
    (:func:`link_users`). Streamed ZeRO-3's gathers are :func:`stream_times`'. The worst link
    counts."""
    pp, dp = st.pp, st.zero_dp
    state = state_bytes_per_param(est.dtype(st.assignment))
    groups = dp_groups(est, st)
    reduce, gather, step = [0.0] * pp, [0.0] * pp, [0.0] * pp
    start = 0
    for s, n in enumerate(split):
        rank = s % pp
        tp = st.tp_of(rank)
        # A LoRA run's frozen base is gathered but neither reduced nor stepped.
        params = float(formulas.stage_held_params(est.model, start, start + n, tp=tp)) \
            + formulas.stage_adapter_params(est.model, est.adapter, start, start + n, tp=tp)
        trained = formulas.stage_trained_params(est.model, est.adapter, start, start + n, tp=tp)
        start += n
        group, wire, bandwidth = groups[rank]
        option = options[s]
        meaning = zero_level(option.level)
        shard = trained / dp if meaning.shards_optimizer else trained
        step[rank] += shard * OPTIMIZER_STEP_BYTES_PER_PARAM / bandwidth
        if dp > 1:
            if not option.streams:
                grads = trained * state.grads * wire
                reduce[rank] += est.comm.collective_time(meaning.reduction, group, grads)
            if meaning.gathers_after_step:
                gathered = params * state.weights * wire
                gather[rank] += est.comm.collective_time(Collective.ALL_GATHER, group, gathered)
    if dp == 1:  # no collectives: the slowest optimizer step
        return max(0.0, *step)
    worst = 0.0
    for ranks in link_users(est, st):
        done = float("-inf")
        for rank in sorted(ranks, reverse=True):  # later ranks finish their backward first
            done = max(done, -rank * stage_time / 2.0) + reduce[rank]
        after = sum(gather[rank] for rank in ranks) + max(step[rank] for rank in ranks)
        worst = max(worst, max(0.0, done) + after)
    return worst


def link_users(est: PlanContext, st: Structure) -> list[tuple[int, ...]]:
    """The pipeline ranks whose DP collectives share a link: each rank alone (its devices' ports),
    and for every node, the ranks whose DP group spans nodes with a member there (the node's
    network port). Cached per structure."""
    key = (st.assignment, st.tp, st.sync_with)
    found = est.link_users.get(key)
    if found is None:
        devices = est.cluster.devices
        sharing: dict[str, set[int]] = {}
        for rank, (group, _, _) in enumerate(dp_groups(est, st)):
            nodes = {devices[d].node for d in group}
            if len(nodes) > 1:
                for node in nodes:
                    sharing.setdefault(node, set()).add(rank)
        found = [(rank,) for rank in range(st.pp)]
        found += sorted({tuple(sorted(ranks)) for ranks in sharing.values() if len(ranks) > 1})
        est.link_users[key] = found
    return found


def dp_groups(est: PlanContext, st: Structure) -> list[tuple[tuple[int, ...], int, float]]:
    """Per pipeline rank: its DP group (the rank's lead device in every replica, and the devices of
    the other replica groups it syncs with, ``Structure.sync_with``), how many TP
    ranks' collectives share its busiest link (:func:`medley.lowering.tp_links.dp_bytes_factor`), and
    the slowest member's memory bandwidth in bytes/s (what the optimizer step streams at). Cached
    per structure, as :func:`network_load` is."""
    key = (st.assignment, st.tp, st.sync_with)
    found = est.dp_groups.get(key)
    if found is None:
        found = est.dp_groups[key] = []
        for rank in range(st.pp):
            group = tuple(row[rank] for row in st.assignment) + st.sync_with
            wire = dp_bytes_factor(est.cluster, group, st.tp_of(rank))  # the other TP ranks' groups
            bandwidth = min(est.cluster.devices[d].type.memory_bandwidth_gbps for d in group) * 1e9
            found.append((group, wire, bandwidth))
    return found
