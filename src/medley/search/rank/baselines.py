"""Baselines over the same simulator, each in the shape a practitioner of its system would run it.

* ``megatron-lm-style``: Megatron-LM's own planning: a uniform layer split, the same
  micro-batch count on every replica, ZeRO-1 (the distributed optimizer; full recomputation on
  every stage only when nothing fits without it), 1F1B or interleaved 1F1B (2 or 4 chunks per
  rank), and the best of a tp x pp x dp grid (the largest dp the devices and the micro-batch count
  allow, ranks in Megatron's order: tp fastest, then dp, then pp). Run twice:
  ``megatron-lm-style-one-type``, on the best single-type sub-cluster (each device type's devices
  alone, the fastest result kept), and ``megatron-lm-style-all-devices``, on every device in
  cluster order.
* ``metis-style``: Metis' search space: device groups per stage following an order of the device
  types (every order is tried), the data-parallel degree of the stage groups (the largest that fits,
  and a power of two using at least half as many devices; one degree for all stages, as medley's
  replicas share their pipeline: Metis' per-stage dp x tp needs tp per stage), layers in proportion
  to each stage's compute capacity moved off stages short of memory (Metis' layer load balancer),
  micro-batches per replica by replica speed, 1F1B, ZeRO-1 with its collectives after the step (no
  bubble placement).
* ``fastest-type-only``: the planner's own candidates (every structure, every allowed schedule
  family, split and memory per stage) on the fastest device type's devices alone.

Each baseline estimates its choices analytically, simulates its best FINALISTS (and the best of
each schedule family) exactly and keeps the fastest that fits (a generous reading: the simulator
picks among their finalists). Megatron and the fastest-type-only plan keep the better of the two
ZeRO collective placements (Megatron overlaps its gradient reduction with the backward).

Tensor parallelism: the Megatron grid's tp dimension is every degree of
``medley.plan.layout.TP_DEGREES`` the model divides and a node of the devices holds
(:func:`medley.search.rules.tp_structures.tp_degrees`; groups from
:func:`medley.search.rules.tp_structures.tp_groups`, consecutive ids on one node of one type). Metis gets
the same uniform degrees and, on mixed devices, a degree per device type
(:func:`medley.search.rules.tp_structures.mixed_structures` in each type order): more TP on the slower
types, as Metis' per-stage dp x tp does. fastest-type-only gets tp from the planner's structures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from itertools import permutations

from medley.errors import MedleyInputError
from medley.schedule.zero_settings import Placement
from medley.search.estimate.context import PlanContext
from medley.search.rank.ranking import RankedPlan, rank_plan
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.rules.builder import MemoryRule, Setting, StagePlan
from medley.search.rules.candidates import Estimator
from medley.search.rules.tp_structures import mixed_structures, tp_degrees, tp_groups
from medley.search.space import PP_CHOICES, Candidate, Constraints, MemoryOption, Structure, memory_option

FINALISTS = 3
"""Candidates simulated per baseline by estimate (besides the best of each schedule family)."""
MEGATRON_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4))
"""Megatron-LM's pipeline schedules: 1F1B, and interleaved 1F1B with 2 or 4 chunks per rank."""
INTERLEAVED_CHUNKS = (2, 4)
"""Chunks per rank tried for interleaved 1F1B by the fastest-type-only baseline."""
MAX_TYPE_ORDERS = 24
"""Most device-type orders Metis-style tries (every order of up to four types)."""

NAMES = ("megatron-lm-style-one-type", "megatron-lm-style-all-devices", "metis-style", "fastest-type-only")
"""The baselines' names, in table order."""

Scored = list[tuple[float, int, Candidate]]


def run_baselines(
    ctx: Estimator, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> dict[str, RankedPlan | None]:
    """Every baseline of :data:`NAMES` over ``devices`` (None where none of its plans fits)."""
    by_type = ctx.cluster.devices_by_type(devices)
    fastest = min(by_type, key=lambda t: (ctx.table(t, 1).total[-1], t))
    singles = [megatron_lm_style(ctx, ids, sizes, constraints) for ids in by_type.values()]
    return {
        "megatron-lm-style-one-type": _fastest(singles),
        "megatron-lm-style-all-devices": megatron_lm_style(ctx, devices, sizes, constraints),
        "metis-style": metis_style(ctx, devices, sizes, constraints),
        "fastest-type-only": fastest_type_only(ctx, by_type[fastest], sizes, constraints),
    }


def _fastest(plans: Sequence[RankedPlan | None]) -> RankedPlan | None:
    found = [p for p in plans if p is not None]
    return max(found, key=lambda p: p.tokens_per_s) if found else None


def _pp_values(ctx: PlanContext, n: int, constraints: Constraints) -> list[int]:
    limit = min(n, ctx.model.num_layers, constraints.max_pp or n)
    return [pp for pp in PP_CHOICES if pp <= limit]


def _zero1_options(dp: int) -> tuple[MemoryOption, MemoryOption]:
    """ZeRO-1 when replicated (Megatron's distributed optimizer), full recomputation only when
    nothing fits without it."""
    level = 1 if dp > 1 else 0
    return memory_option(level), memory_option(level, recompute=True)


def one_option_for_all(choices: Sequence[MemoryOption] | None = None) -> MemoryRule:
    """Memory rule: the first of ``choices`` (default: the setting's ladder) under which every
    stage fits its devices (at the family's in-flight depth), the same option on every stage."""

    def rule(setting: Setting, split: tuple[int, ...]) -> StagePlan | None:
        ladder = setting.ladder if choices is None else tuple(choices)
        narrowed = replace(setting, ladder=ladder)
        interleaved = setting.family == "interleaved"
        per_stage = memory_rules.cheapest_per_rank if interleaved else memory_rules.cheapest_per_stage
        plan = per_stage(narrowed, split, finer=False)  # all-or-nothing recomputation, as they do
        if plan is None:
            return None
        worst = max(plan.options, key=ladder.index)
        return StagePlan(stage_layers=plan.stage_layers, options=(worst,) * len(plan.options))

    return rule


def add_candidate(scored: Scored, make: Callable[[], Candidate | None]) -> None:
    """Append the candidate ``make`` builds, if any (a cost source that cannot answer a
    micro-batch size raises ValueError: that candidate is skipped)."""
    try:
        candidate = make()
    except ValueError:
        return
    if candidate is not None:
        scored.append((candidate.estimate_s, len(scored), candidate))


def simulate_finalists(
    ctx: PlanContext,
    scored: Scored,
    constraints: Constraints,
    placements: Sequence[Placement],
    finalists: int = FINALISTS,
) -> RankedPlan | None:
    """The fastest plan of :func:`rank_finalists` (None when none fits)."""
    ranked = rank_finalists(ctx, scored, constraints, placements, finalists)
    return ranked[0] if ranked else None


def rank_finalists(
    ctx: PlanContext,
    scored: Scored,
    constraints: Constraints,
    placements: Sequence[Placement],
    finalists: int = FINALISTS,
) -> list[RankedPlan]:
    """Simulate the ``finalists`` best by estimate and the best of each family and set of tp
    degrees (the estimate is optimistic for TP structures: they must not crowd the others out)
    under each of ``placements``; those that fit, fastest first."""
    scored = sorted(scored, key=lambda x: (x[0], x[1]))
    chosen: dict[object, Candidate] = {}
    for _, _, candidate in scored[:finalists]:
        chosen.setdefault(candidate.key, candidate)
    families: set[tuple[str, int, tuple[int, ...]]] = set()
    for _, _, candidate in scored:
        chunks = int(candidate.knobs.get("virtual_stages", 1))
        variant = (candidate.family, chunks, tp_set(candidate.structure))
        if variant not in families:
            families.add(variant)
            chosen.setdefault(candidate.key, candidate)
    fitting: list[RankedPlan] = []
    for candidate in chosen.values():
        base = candidate.layout(ctx.model, ctx.seq_len)
        for placement in placements:
            layout = base if placement is base.placement else replace(base, placement=placement)
            try:
                ranked = rank_plan(candidate, layout, ctx.cluster, ctx.cost, constraints.memory_headroom,
                                   pricing=ctx.pricing)
            except (ValueError, MedleyInputError):  # a layout the compiler rejects
                continue
            if ranked.fits:
                fitting.append(ranked)
    return sorted(fitting, key=lambda p: -p.tokens_per_s)  # stable: the first found wins a tie


def tp_set(st: Structure) -> tuple[int, ...]:
    """The distinct tp degrees of a structure's pipeline ranks, ascending."""
    return tuple(sorted(set(st.tp or (1,))))


# --- Megatron-LM ----------------------------------------------------------------------------------
def _megatron_dp(devices: int, micro_batches: int) -> int:
    """The largest dp the devices allow that divides the micro-batch count (Megatron runs the
    same count on every replica)."""
    dp = min(devices, micro_batches)
    while dp > 1 and micro_batches % dp:
        dp -= 1
    return max(dp, 1)


def megatron_structures(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> Iterator[Structure]:
    """Megatron's tp x pp x dp grid over ``devices`` in cluster order (group of replica r's rank
    k: the (k*dp + r)-th TP group of :func:`tp_groups`, runs of tp devices on one node and type)."""
    ordered = sorted(devices)
    for tp in tp_degrees(ctx, ordered):
        leads = tp_groups(ctx, ordered, tp)
        for pp in _pp_values(ctx, len(leads), constraints):
            for mbs in sizes:
                dp = _megatron_dp(len(leads) // pp, ctx.global_batch // mbs)
                if dp < 1 or ctx.global_batch // mbs < 1:
                    continue
                yield Structure(
                    pool="megatron-lm-style",
                    strategy="cluster-order",
                    pp=pp,
                    dp=dp,
                    assignment=tuple(tuple(leads[k * dp + r] for k in range(pp)) for r in range(dp)),
                    micro_batch_size=mbs,
                    tp=() if tp == 1 else (tp,) * pp,
                )


def megatron_lm_style(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    """Megatron-LM's best grid point on ``devices`` (see the module's docstring)."""
    scored: Scored = []
    for st in megatron_structures(ctx, devices, sizes, constraints):
        for family, chunks in MEGATRON_SCHEDULES:
            if family == "interleaved" and (st.pp < 2 or st.pp * chunks > ctx.model.num_layers):
                continue
            add_candidate(
                scored,
                lambda st=st, family=family, chunks=chunks: builder.build(
                    ctx,
                    st,
                    family,
                    split=split_rules.uniform,
                    memory=one_option_for_all(_zero1_options(st.dp)),
                    micro_batches=builder.equal_micro_batches(),
                    virtual_stages=chunks,
                ),
            )
    return simulate_finalists(ctx, scored, constraints, (Placement.BUBBLE, Placement.NAIVE))


# --- Metis ----------------------------------------------------------------------------------------
def _dp_values(most: int, micro_batches: int) -> list[int]:
    """Metis' data-parallel degrees of the stage groups: ``most`` (all the devices pp allows, at
    most one per micro-batch) and the powers of two that still use at least half as many."""
    top = min(most, micro_batches)
    values = {top}
    power = 1
    while power < top:
        if 2 * power >= top:
            values.add(power)
        power *= 2
    return sorted(values, reverse=True)


def _type_orders(ctx: PlanContext, by_type: dict[str, list[int]]) -> list[tuple[str, ...]]:
    """Every order of the device types (the first MAX_TYPE_ORDERS, fastest first)."""
    types = sorted(by_type, key=lambda t: (ctx.table(t, 1).total[-1], t))
    return list(permutations(types))[:MAX_TYPE_ORDERS]


def metis_structures(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> Iterator[Structure]:
    """Metis' structures: for each type order, tp, pp, micro-batch size and dp, the stage groups
    as consecutive runs of dp TP groups of that order (one degree for all stages), then the
    structures with a degree per device type (:func:`mixed_structures`) in each type order."""
    by_type = ctx.cluster.devices_by_type(devices)
    seen: set[tuple[object, ...]] = set()
    for types in _type_orders(ctx, by_type):
        for tp in tp_degrees(ctx, devices):
            order = [u for t in types for u in tp_groups(ctx, by_type[t], tp)]
            for pp in _pp_values(ctx, len(order), constraints):
                for mbs in sizes:
                    for dp in _dp_values(len(order) // pp, ctx.global_batch // mbs):
                        assignment = ctx.assign(order, pp, dp, "stage-major")
                        if (assignment, mbs, tp) in seen:
                            continue
                        seen.add((assignment, mbs, tp))
                        yield Structure(
                            pool="metis-style",
                            strategy="type-order",
                            pp=pp,
                            dp=dp,
                            assignment=assignment,
                            micro_batch_size=mbs,
                            tp=(tp,) * pp if tp > 1 else (),
                        )
        max_pp = min(constraints.max_pp or ctx.model.num_layers, ctx.model.num_layers)
        yield from mixed_structures(ctx, "metis-style", devices, max_pp=max_pp, micro_batch_sizes=sizes,
                                    type_order=types, strategy="type-order")


def metis_style(
    ctx: PlanContext, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    """Metis' best plan on ``devices`` (see the module's docstring).

    Its layer load balancer is costly on large clusters, so structures are balanced in the order
    of a quick estimate (the capacity split under ZeRO-1 alone, before any layer moves) and the
    search skips a structure once that quick estimate cannot beat the FINALISTS-th balanced one of
    the same tp degrees (balancing only moves layers off memory-short stages and recomputes where
    nothing fits: it rarely makes a structure faster)."""
    quick: Scored = []
    for st in metis_structures(ctx, devices, sizes, constraints):
        add_candidate(quick, lambda st=st: _metis(ctx, st, memory_rules.fixed(_zero1_options(st.dp)[0])))
    quick.sort(key=lambda x: (x[0], x[1]))
    scored: Scored = []
    for bound, _, first in quick:
        st = first.structure
        done = sorted(e for e, _, c in scored if tp_set(c.structure) == tp_set(st))
        if len(done) >= FINALISTS and bound >= done[FINALISTS - 1]:
            continue
        add_candidate(scored, lambda st=st: _metis(
            ctx, st, memory_rules.rebalanced_uniform_fit(_zero1_options(st.dp))))
    return simulate_finalists(ctx, scored, constraints, (Placement.NAIVE,))


def _metis(ctx: PlanContext, st: Structure, memory: MemoryRule) -> Candidate | None:
    return builder.build(
        ctx, st, "1f1b", split=split_rules.by_stage_capacity, memory=memory,
        micro_batches=builder.by_replica_speed(),
    )


# --- fastest type only ----------------------------------------------------------------------------
def fastest_type_only(
    ctx: Estimator, devices: Sequence[int], sizes: Sequence[int], constraints: Constraints
) -> RankedPlan | None:
    """The planner's own candidates on ``devices`` (one device type), every allowed family."""
    max_pp = min(constraints.max_pp or ctx.model.num_layers, ctx.model.num_layers)
    variants = [
        (family, chunks)
        for family in constraints.schedules
        for chunks in (INTERLEAVED_CHUNKS if family == "interleaved" else (1,))
    ]
    scored: Scored = []
    for st in ctx.structures({"fastest-type-only": list(devices)}, max_pp=max_pp, micro_batch_sizes=sizes):
        for family, chunks in variants:
            if family != "1f1b" and st.pp == 1:
                continue
            knobs = {"virtual_stages": chunks} if family == "interleaved" else {}
            add_candidate(scored, lambda st=st, f=family, knobs=knobs: ctx.candidate(st, f, **knobs))
    return simulate_finalists(ctx, scored, constraints, (Placement.BUBBLE, Placement.NAIVE))
