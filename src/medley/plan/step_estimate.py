"""The planner's analytic step time of a candidate, and the interleaved family's candidates.

:func:`step_estimate`: the slowest replica's pipeline (:func:`medley.plan.bounds.pipeline_time`
over its stages' F+B+W, its boundary transfers and streamed ZeRO-3 traffic) plus the worst stage's
exposed data-parallel work (optimizer step, the gradient reduction past the stage's tail bubble).
Only used to prune and order candidates; the simulator gives every reported figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from medley.cost import formulas
from medley.cost.interfaces import Collective
from medley.plan.bounds import MemoryOption, bottleneck_split, memory_options, pipeline_time, stage_memory
from medley.plan.compile import OPTIMIZER_STEP_BYTES_PER_PARAM
from medley.plan.space import Candidate, Structure

if TYPE_CHECKING:
    from medley.plan.candidates import Estimator


def step_estimate(
    est: Estimator, st, family, split, options, micro_batches, signatures, virtual_stages: int = 1
) -> float:
    """Estimated step seconds: slowest replica's pipeline plus the worst stage's exposed DP work."""
    mbs, pp = st.micro_batch_size, st.pp
    chain = len(split)
    worst = 0.0
    rank_busy = 0.0
    stream = stream_times(est, st, family, split, options)
    stage_of_rank = [[s for s in range(chain) if s % pp == k] for k in range(pp)]
    for sig, members in signatures:
        row = st.assignment[members[0]]
        # Streamed ZeRO-3 gathers mostly wait in line with the compute (the simulator shows
        # little overlap), so they are counted on top of it.
        times = [
            sum(est._stage_time(sig[k], split, s, options[s], mbs) + stream[s] for s in stage_of_rank[k])
            for k in range(pp)
        ]
        weights = []
        for k in range(pp):
            tab = est.table(sig[k], mbs)
            weights.append(
                sum(
                    tab.weight[sum(split[:s]) + split[s]] - tab.weight[sum(split[:s])]
                    for s in stage_of_rank[k]
                )
            )
        links = [est.boundary_time(row[k], row[k + 1], mbs) for k in range(pp - 1)]
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
            ),
        )
        rank_busy = max(rank_busy, max(times))
    return worst + exposed_dp(est, st, split, options, micro_batches, rank_busy)


def stream_times(est: Estimator, st, family, split, options) -> list[float]:
    """Per stage, one micro-batch's streamed ZeRO-3 traffic: a gather per compute action
    (F and the backward, or F, B and W) and a reduce-scatter of the gradient."""
    out = []
    start = 0
    actions = 3 if family == "zb-h1" else 2
    for s, n in enumerate(split):
        if not options[s].streams or st.dp == 1:
            out.append(0.0)
            start += n
            continue
        params = float(formulas.stage_held_params(est.model, start, start + n))
        start += n
        group = tuple(row[s % st.pp] for row in st.assignment)
        gather = est.comm.collective_time(Collective.ALL_GATHER, group, params * 2.0)
        scatter = est.comm.collective_time(Collective.REDUCE_SCATTER, group, params * 2.0)
        out.append(actions * gather + scatter)
    return out


def exposed_dp(est: Estimator, st, split, options, micro_batches, stage_time) -> float:
    """Per stage: optimizer step, plus the reduction past the tail bubble, plus streamed ZeRO-3
    gathers not hidden behind compute; the worst stage counts."""
    pp, dp = st.pp, st.dp
    worst = 0.0
    start = 0
    for s, n in enumerate(split):
        rank = s % pp
        params = float(formulas.stage_held_params(est.model, start, start + n))
        start += n
        group = tuple(st.assignment[r][rank] for r in range(dp))
        bandwidth = min(est.cluster.devices[d].type.memory_bandwidth_gbps for d in group) * 1e9
        option = options[s]
        shard = params / dp if option.level >= 1 else params
        exposed = shard * OPTIMIZER_STEP_BYTES_PER_PARAM / bandwidth
        if dp > 1:
            grads = params * 2.0
            reduce = est.comm.collective_time(Collective.ALL_REDUCE, group, grads)
            tail = rank * stage_time / 2.0
            if not option.streams:
                exposed += max(0.0, reduce - tail)
        worst = max(worst, exposed)
    return worst


def interleaved_candidate(est: Estimator, st: Structure, v: int) -> Candidate | None:
    """Megatron's interleaved 1F1B with ``v`` chunks per rank on ``st`` (None when it cannot fit)."""
    pp = st.pp
    stages = pp * v
    if pp < 2 or stages > est.model.num_layers:
        return None
    base = est.candidate(st, "1f1b")
    if base is None:
        return None
    dtype, mbs, dp = base.dtype, st.micro_batch_size, st.dp
    signatures = est._signatures(st)
    counts = [base.micro_batches[members[0]] for _, members in signatures]
    # Chunk c runs on rank c % pp; the split is over the chunks in pipeline order, time only,
    # then each rank's memory (all its chunks, Megatron's warm-up depth) is checked.
    chunk_types = [
        sorted({(sig[c % pp], n) for (sig, _), n in zip(signatures, counts, strict=True)})
        for c in range(stages)
    ]
    num_layers = est.model.num_layers
    slowest = max(est.table(t, mbs).total[-1] * n for c in range(stages) for t, n in chunk_types[c])

    def stage_end(s: int, i: int, t: float) -> int:
        return min(est.table(ty, mbs, dtype).max_end(i, t / n) for ty, n in chunk_types[s])

    found = bottleneck_split(num_layers, stages, stage_end, lo=0.0, hi=slowest * 1.0001)
    if found is None:
        return None
    split, _ = found
    m = max(counts)
    ladder = memory_options(dp)
    options: list[MemoryOption | None] = [None] * stages
    starts = [sum(split[:c]) for c in range(stages)]
    for rank in range(pp):
        chunks = [c for c in range(stages) if c % pp == rank]
        depth = min(m * v, 2 * (pp - rank - 1) + (v - 1) * min(m, pp) + 1)
        types = {sig[rank] for sig, _ in signatures}
        cap = {
            t: min(
                est.capacity(row[rank])
                for row in st.assignment
                if est.cluster.devices[row[rank]].type.name == t
            )
            for t in types
        }
        fit = None
        for option in ladder:
            ok = all(
                sum(
                    stage_memory(
                        est.table(t, mbs, dtype),
                        starts[c],
                        starts[c] + split[c],
                        option=option,
                        dp=dp,
                        in_flight=depth / v,
                    )
                    for c in chunks
                )
                <= cap[t]
                for t in types
            )
            if ok:
                fit = option
                break
        if fit is None:
            return None
        for c in chunks:
            options[c] = fit
    final = tuple(o for o in options if o is not None)
    estimate = step_estimate(
        est, st, "interleaved", split, final, base.micro_batches, signatures, virtual_stages=v
    )
    return Candidate(
        structure=st,
        family="interleaved",
        knobs={"virtual_stages": v},
        micro_batches=base.micro_batches,
        stage_layers=split,
        options=final,
        estimate_s=estimate,
        dtype=dtype,
    )
