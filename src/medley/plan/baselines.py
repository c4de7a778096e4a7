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
Both are configurations of :func:`medley.plan.builder.build`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from medley.plan import builder, memory_rules, split_rules
from medley.plan.bounds import MemoryOption
from medley.plan.context import PlanContext
from medley.plan.ranking import RankedPlan, rank_plan
from medley.plan.space import PP_CHOICES, Candidate, Constraints, Structure
from medley.schedule.zero import Placement

FINALISTS = 3


def run_baselines(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> dict[str, RankedPlan | None]:
    cluster = ctx.cluster
    speed = {d: ctx.table(cluster.devices[d].type.name, 1).total[-1] for d in devices}
    fastest = min(speed.values())
    fast_devices = [d for d in devices if speed[d] == fastest]
    return {
        "megatron-style": megatron_style(ctx, devices, sizes, constraints),
        "fastest-type-only": megatron_style(ctx, fast_devices, sizes, constraints),
        "metis-style": metis_style(ctx, devices, sizes, constraints),
    }


def _pp_values(ctx: PlanContext, n: int, constraints: Constraints) -> list[int]:
    limit = min(n, ctx.model.num_layers, constraints.max_pp or n)
    return [pp for pp in PP_CHOICES if pp <= limit]


def _plain_options(dp: int) -> tuple[MemoryOption, MemoryOption]:
    """ZeRO-1 when replicated (Megatron's distributed optimizer), full recomputation only when
    nothing fits without it."""
    level = 1 if dp > 1 else 0
    return MemoryOption(level=level), MemoryOption(level=level, recompute=True)


def _finish(
    ctx: PlanContext,
    scored: list[tuple[float, int, Candidate]],
    constraints: Constraints,
    placement: Placement = Placement.BUBBLE,
) -> RankedPlan | None:
    scored.sort(key=lambda x: (x[0], x[1]))
    best = None
    for _, _, candidate in scored[:FINALISTS]:
        layout = candidate.layout(ctx.model, ctx.seq_len)
        if placement is not Placement.BUBBLE:
            layout = replace(layout, placement=placement)
        ranked = rank_plan(candidate, layout, ctx.cluster, ctx.cost, constraints.memory_headroom)
        if ranked.fits and (best is None or ranked.tokens_per_s > best.tokens_per_s):
            best = ranked
    return best


def megatron_style(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    cluster = ctx.cluster
    types = {cluster.devices[d].type.name for d in devices}
    slowest = max(types, key=lambda t: (ctx.table(t, 1).total[-1], t))
    capacity = min(ctx.capacity(d) for d in devices)
    ordered = sorted(devices)
    scored: list[tuple[float, int, Candidate]] = []
    index = 0
    for pp in _pp_values(ctx, len(devices), constraints):
        for mbs in sizes:
            total = ctx.global_batch // mbs
            dp = min(len(devices) // pp, total)
            while dp > 1 and total % dp:
                dp -= 1  # Megatron needs equal micro-batches per replica
            index += 1
            assignment = tuple(tuple(ordered[k * dp + r] for k in range(pp)) for r in range(dp))
            structure = Structure(
                pool="baseline",
                strategy="cluster-order",
                pp=pp,
                dp=dp,
                assignment=assignment,
                micro_batch_size=mbs,
            )
            try:
                candidate = builder.build(
                    ctx,
                    structure,
                    "1f1b",
                    split=split_rules.uniform,
                    memory=memory_rules.first_uniform_fit(
                        _plain_options(dp), device_type=slowest, capacity=capacity
                    ),
                    micro_batches=builder.equal_micro_batches(),
                    estimate=builder.homogeneous_1f1b(slowest),
                )
            except ValueError:  # the cost source cannot answer this micro-batch size
                continue
            if candidate is not None:
                scored.append((candidate.estimate_s, index, candidate))
    return _finish(ctx, scored, constraints)


def metis_style(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    cluster = ctx.cluster
    by_speed = sorted(devices, key=lambda d: (ctx.table(cluster.devices[d].type.name, 1).total[-1], d))
    scored: list[tuple[float, int, Candidate]] = []
    index = 0
    for pp in _pp_values(ctx, len(devices), constraints):
        for mbs in sizes:
            index += 1
            total = ctx.global_batch // mbs
            dp = min(len(devices) // pp, total)
            structure = Structure(
                pool="baseline",
                strategy="stage-major",
                pp=pp,
                dp=dp,
                assignment=ctx.assign(by_speed, pp, dp, "stage-major"),
                micro_batch_size=mbs,
            )
            try:
                candidate = builder.build(
                    ctx,
                    structure,
                    "1f1b",
                    split=split_rules.by_stage_capacity,
                    memory=memory_rules.rebalanced_uniform_fit(_plain_options(dp)),
                    micro_batches=builder.by_replica_speed(),
                )
            except ValueError:
                continue
            if candidate is not None:
                scored.append((candidate.estimate_s, index, candidate))
    return _finish(ctx, scored, constraints, placement=Placement.NAIVE)
