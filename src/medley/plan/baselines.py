"""Baselines over the same simulator, for the benchmark and ``--explain``.

* ``megatron-style``: what a homogeneous planner does. Uniform layer split, 1F1B, equal
  micro-batches, ZeRO-1 (Megatron's distributed optimizer), devices in cluster order; pp x dp and
  micro-batch size chosen as if every device were the slowest (and smallest) type present. Full
  recomputation only when nothing fits without it.
* ``fastest-type-only``: the same, on the fastest type's devices alone (the slower ones idle).
* ``metis-style``: heterogeneity-aware balancing as Metis does it, without ZeRO co-design: device
  groups by type along the pipeline, layers in proportion to each stage's compute capacity (then moved off
  stages short of memory), micro-batches per replica in proportion to replica speed, ZeRO-1 on
  every stage with collectives placed after the step (no bubble placement).

Each baseline estimates its own choices analytically, simulates its best three exactly and keeps
the fastest that fits (a generous reading of each: the simulator picks among their finalists).
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.plan.bounds import MemoryOption, pipeline_time, stage_memory
from medley.plan.candidates import Estimator
from medley.plan.inline import balanced_split
from medley.plan.ranking import RankedPlan, rank_plan
from medley.plan.search import Constraints
from medley.plan.space import PP_CHOICES, Candidate, Structure, distribute
from medley.schedule.zero import Placement

FINALISTS = 3


def run_baselines(
    estimator: Estimator, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> dict[str, RankedPlan | None]:
    cluster = estimator.cluster
    speed = {d: estimator.table(cluster.devices[d].type.name, 1).total[-1] for d in devices}
    fastest = min(speed.values())
    fast_devices = [d for d in devices if speed[d] == fastest]
    return {
        "megatron-style": megatron_style(estimator, devices, sizes, constraints),
        "fastest-type-only": megatron_style(estimator, fast_devices, sizes, constraints),
        "metis-style": metis_style(estimator, devices, sizes, constraints),
    }


def _pp_values(estimator: Estimator, n: int, constraints: Constraints) -> list[int]:
    limit = min(n, estimator.model.num_layers, constraints.max_pp or n)
    return [pp for pp in PP_CHOICES if pp <= limit]


def _finish(
    estimator: Estimator,
    scored: list[tuple[float, int, Candidate]],
    constraints: Constraints,
    placement: Placement = Placement.BUBBLE,
) -> RankedPlan | None:
    scored.sort(key=lambda x: (x[0], x[1]))
    best = None
    for _, _, candidate in scored[:FINALISTS]:
        layout = candidate.layout(estimator.model, estimator.seq_len)
        if placement is not Placement.BUBBLE:
            from dataclasses import replace

            layout = replace(layout, placement=placement)
        ranked = rank_plan(candidate, layout, estimator.cluster, estimator.cost, constraints.memory_headroom)
        if ranked.fits and (best is None or ranked.tokens_per_s > best.tokens_per_s):
            best = ranked
    return best


def megatron_style(
    estimator: Estimator, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    cluster, model = estimator.cluster, estimator.model
    types = {cluster.devices[d].type.name for d in devices}
    slowest = max(types, key=lambda t: (estimator.table(t, 1).total[-1], t))
    capacity = min(estimator.capacity(d) for d in devices)
    ordered = sorted(devices)
    scored: list[tuple[float, int, Candidate]] = []
    index = 0
    for pp in _pp_values(estimator, len(devices), constraints):
        split = balanced_split(model, [1.0] * pp)
        for mbs in sizes:
            total = estimator.global_batch // mbs
            dp = min(len(devices) // pp, total)
            while dp > 1 and total % dp:
                dp -= 1  # Megatron needs equal micro-batches per replica
            index += 1
            try:
                table = estimator.table(slowest, mbs)
            except ValueError:
                continue
            level = 1 if dp > 1 else 0
            starts = [sum(split[:s]) for s in range(pp)]
            m = total // dp
            chosen = None
            for recompute in (False, True):
                option = MemoryOption(level=level, recompute=recompute)
                if all(
                    stage_memory(
                        table, starts[s], starts[s] + split[s], option=option, dp=dp, in_flight=min(pp - s, m)
                    )
                    <= capacity
                    for s in range(pp)
                ):
                    chosen = option
                    break
            if chosen is None:
                continue
            times = [
                table.time(starts[s], starts[s] + split[s], recompute=chosen.recompute) for s in range(pp)
            ]
            estimate = pipeline_time(
                "1f1b", stage_times=times, stage_weight_times=[0.0] * pp, link_times=[], micro_batches=m
            )
            assignment = tuple(tuple(ordered[k * dp + r] for k in range(pp)) for r in range(dp))
            structure = Structure(
                pool="baseline",
                strategy="cluster-order",
                pp=pp,
                dp=dp,
                assignment=assignment,
                micro_batch_size=mbs,
            )
            candidate = Candidate(
                structure=structure,
                family="1f1b",
                micro_batches=(m,) * dp,
                stage_layers=split,
                options=(chosen,) * pp,
                estimate_s=estimate,
                dtype=estimator.dtype(assignment),
            )
            scored.append((estimate, index, candidate))
    return _finish(estimator, scored, constraints)


def metis_style(
    estimator: Estimator, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    cluster = estimator.cluster
    by_speed = sorted(devices, key=lambda d: (estimator.table(cluster.devices[d].type.name, 1).total[-1], d))
    scored: list[tuple[float, int, Candidate]] = []
    index = 0
    for pp in _pp_values(estimator, len(devices), constraints):
        for mbs in sizes:
            index += 1
            total = estimator.global_batch // mbs
            dp = min(len(devices) // pp, total)
            assignment = estimator.assign(by_speed, pp, dp, "stage-major")
            try:
                candidate = _metis_candidate(estimator, assignment, pp, dp, mbs, total)
            except ValueError:
                continue
            if candidate is not None:
                scored.append((candidate.estimate_s, index, candidate))
    return _finish(estimator, scored, constraints, placement=Placement.NAIVE)


def _metis_candidate(
    estimator: Estimator, assignment, pp: int, dp: int, mbs: int, total: int
) -> Candidate | None:
    cluster, model = estimator.cluster, estimator.model
    name = [[cluster.devices[assignment[r][k]].type.name for k in range(pp)] for r in range(dp)]
    speed = {t: 1.0 / estimator.table(t, mbs).total[-1] for row in name for t in row}
    # Stage capacity: the sum of its members' speeds (Metis splits the data inside a stage by speed).
    capacity = [sum(speed[name[r][k]] for r in range(dp)) for k in range(pp)]
    split = list(balanced_split(model, capacity))
    level = 1 if dp > 1 else 0
    replica_speed = [1.0 / max(1.0 / speed[t] for t in row) for row in name]
    micro_batches = distribute(total, replica_speed)
    m = max(micro_batches)
    caps = [min(estimator.capacity(assignment[r][k]) for r in range(dp)) for k in range(pp)]

    def memory(k: int, option: MemoryOption) -> float:
        start = sum(split[:k])
        return max(
            stage_memory(
                estimator.table(t, mbs),
                start,
                start + split[k],
                option=option,
                dp=dp,
                in_flight=min(pp - k, m),
            )
            for t in {name[r][k] for r in range(dp)}
        )

    for recompute in (False, True):
        option = MemoryOption(level=level, recompute=recompute)
        for _ in range(4 * model.num_layers):  # LayerLoadBalancer: move layers off memory-short stages
            over = [k for k in range(pp) if memory(k, option) > caps[k]]
            if not over:
                break
            k = over[0]
            if split[k] <= 1:
                break
            room = [j for j in (k - 1, k + 1) if 0 <= j < pp and memory(j, option) < caps[j]]
            if not room:
                break
            split[k] -= 1
            split[max(room, key=lambda j: caps[j] - memory(j, option))] += 1
        if all(memory(k, option) <= caps[k] for k in range(pp)):
            break
    else:
        return None
    structure = Structure(
        pool="baseline", strategy="stage-major", pp=pp, dp=dp, assignment=assignment, micro_batch_size=mbs
    )
    signatures = estimator._signatures(structure)
    options = (option,) * pp
    estimate = estimator.estimate(structure, "1f1b", tuple(split), options, micro_batches, signatures)
    return Candidate(
        structure=structure,
        family="1f1b",
        micro_batches=micro_batches,
        stage_layers=tuple(split),
        options=options,
        estimate_s=estimate,
        dtype=estimator.dtype(assignment),
    )
