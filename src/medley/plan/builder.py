"""One way to turn a structure into a candidate: :func:`build`, configured by small rules.

A candidate is a structure (devices and their roles) plus a schedule family, micro-batches per
replica, a layer split and a memory option per stage, and an analytic step estimate. :func:`build`
fixes the order in which those are chosen; the rules say how:

* micro-batches (:class:`MicroBatchRule`): :func:`balanced_micro_batches` (by replica speed, then
  once more from the split's bottlenecks), :func:`by_replica_speed`, :func:`equal_micro_batches`,
  :func:`given_micro_batches`;
* the split (:data:`SplitRule`): :func:`bottleneck` (the fastest split under each device's
  memory), :func:`interleaved_chunks` (over the chunks of interleaved 1F1B, time only),
  :func:`uniform` (Megatron), :func:`by_stage_capacity` (Metis);
* memory (:data:`MemoryRule`): :func:`cheapest_per_stage`, :func:`cheapest_per_rank` (every chunk
  of a rank alike), :func:`first_uniform_fit` (one option for every stage),
  :func:`rebalanced_uniform_fit` (Metis' layer load balancer), :func:`fixed`;
* the estimate (:data:`EstimateRule`): :func:`analytic` (:mod:`medley.plan.step_estimate`),
  :func:`homogeneous_1f1b`, :func:`no_estimate`.

The planner's own candidates (:class:`~medley.plan.candidates.Estimator`), the baselines
(:mod:`medley.plan.baselines`) and the least-memory plan behind "fits nowhere"
(:mod:`medley.plan.shortfall`) are configurations of it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from medley.errors import MedleyInputError
from medley.plan.bounds import (
    Flight,
    MemoryOption,
    bottleneck_split,
    memory_options,
    pipeline_time,
    stage_memory,
)
from medley.plan.context import PlanContext, Signatures
from medley.plan.space import Candidate, Structure, distribute
from medley.plan.step_estimate import step_estimate
from medley.spec.model import ModelSpec

# Bottleneck sweep bounds: the continuous optimum (every stage takes the share of the model its
# speed allows) is a lower bound on the bottleneck; the split is rarely more than a few layers'
# time above it, so the first search stops at 1.5x and only falls back to the slowest stage's
# whole-model time (with recomputation) when that is too tight.
SWEEP_LOW = 0.999
SWEEP_HIGH = 1.5
SWEEP_FALLBACK = 1.0001


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What the split and memory rules see for one structure, family and micro-batch count.

    Attributes:
        ctx: the planning context; structure, family: what is being built.
        signatures: replicas grouped by the device types of their ranks.
        micro_batches: per replica; counts: per signature (its first replica's).
        flights: in-flight micro-batches per stage at the family's warm-up depths.
        dtype: training precision; virtual_stages: chunks per rank (interleaved 1F1B).
    """

    ctx: PlanContext
    structure: Structure
    family: str
    signatures: Signatures
    micro_batches: tuple[int, ...]
    counts: list[int]
    flights: list[Flight]
    dtype: str
    virtual_stages: int

    @property
    def num_stages(self) -> int:
        return self.structure.pp * self.virtual_stages

    def stage_types(self, stage: int) -> list[tuple[str, int]]:
        """(device type, micro-batches) of each signature at ``stage``'s rank, sorted, unique."""
        rank = stage % self.structure.pp
        pairs = zip(self.signatures, self.counts, strict=True)
        return sorted({(sig[rank], c) for (sig, _), c in pairs})


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """Layers and memory option per stage."""

    stage_layers: tuple[int, ...]
    options: tuple[MemoryOption, ...]


SplitRule = Callable[[Setting], "tuple[int, ...] | None"]
"""Layers per stage for a setting, or None when no split fits."""
MemoryRule = Callable[[Setting, "tuple[int, ...]"], "StagePlan | None"]
"""Memory option per stage for a split (a rule may also move layers), or None when it cannot fit."""
EstimateRule = Callable[[Setting, StagePlan], float]
"""Estimated step seconds of a placed candidate."""


# --- micro-batches ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MicroBatchRule:
    """Micro-batches per replica: ``first`` before any split; ``refine`` from a placed split (the
    same counts when the rule does not revisit them); at most ``rounds`` splits are made."""

    first: Callable[[PlanContext, Structure, Signatures, int], tuple[int, ...]]
    refine: Callable[[Setting, StagePlan], tuple[int, ...]] | None = None
    rounds: int = 1


def _whole_model_weights(
    ctx: PlanContext, st: Structure, signatures: Signatures, total: int
) -> tuple[int, ...]:
    mbs = st.micro_batch_size
    weights = [1.0 / sum(ctx.table(t, mbs).total[-1] for t in sig) for sig, _ in signatures]
    return ctx.micro_batches(st, signatures, weights, total)


def _bottleneck_weights(setting: Setting, plan: StagePlan) -> tuple[int, ...]:
    ctx, st = setting.ctx, setting.structure
    mbs, split, options = st.micro_batch_size, plan.stage_layers, plan.options
    bottlenecks = [
        max(ctx.stage_time(sig[s], split, s, options[s], mbs) for s in range(st.pp))
        for sig, _ in setting.signatures
    ]
    total = ctx.global_batch // mbs
    return ctx.micro_batches(st, setting.signatures, [1.0 / b for b in bottlenecks], total)


def balanced_micro_batches() -> MicroBatchRule:
    """In proportion to each replica's whole-model speed, then once more to the speed of its
    split's slowest stage (two splits at most)."""
    return MicroBatchRule(first=_whole_model_weights, refine=_bottleneck_weights, rounds=2)


def by_replica_speed() -> MicroBatchRule:
    """In proportion to each replica's speed, its slowest device's whole-model time (Metis)."""

    def first(ctx: PlanContext, st: Structure, signatures: Signatures, total: int) -> tuple[int, ...]:
        mbs = st.micro_batch_size
        names = [[ctx.cluster.devices[d].type.name for d in row] for row in st.assignment]
        speed = {t: 1.0 / ctx.table(t, mbs).total[-1] for row in names for t in row}
        return distribute(total, [1.0 / max(1.0 / speed[t] for t in row) for row in names])

    return MicroBatchRule(first=first)


def equal_micro_batches() -> MicroBatchRule:
    """The same count on every replica (the first ones take one more when it does not divide)."""

    def first(ctx: PlanContext, st: Structure, signatures: Signatures, total: int) -> tuple[int, ...]:
        return tuple(total // st.dp + (1 if r < total % st.dp else 0) for r in range(st.dp))

    return MicroBatchRule(first=first)


def given_micro_batches(counts: tuple[int, ...]) -> MicroBatchRule:
    return MicroBatchRule(first=lambda ctx, st, signatures, total: counts)


# --- in-flight micro-batches -------------------------------------------------------------------
def warmup_depths(
    ctx: PlanContext, st: Structure, family: str, m: int, signatures: Signatures
) -> tuple[int, ...] | None:
    """Warm-up depth per stage; hetero-1f1b deepens it before slow links (HARP's launch
    micro-batches: +1 per boundary, +1..3 across nodes by the transfer's share of a stage's
    time). None when hetero-1f1b would equal 1F1B."""
    pp = st.pp
    if family == "gpipe":
        return (m,) * pp
    base = tuple(min(pp - s, m) for s in range(pp))
    if family != "hetero-1f1b":
        return base
    mbs = st.micro_batch_size
    t_stage = max(ctx.table(t, mbs).total[-1] for sig, _ in signatures for t in sig) / pp
    depths = [1] * pp
    for s in range(pp - 2, -1, -1):
        link = max(ctx.boundary_time(r[s], r[s + 1], mbs) for r in st.assignment)
        same_node = all(
            ctx.cluster.devices[r[s]].node == ctx.cluster.devices[r[s + 1]].node for r in st.assignment
        )
        step = 1 if same_node else (1 if link < t_stage / 10 else 2 if link < t_stage / 2 else 3)
        depths[s] = depths[s + 1] + step
    clipped = tuple(min(d, m) for d in depths)
    return None if clipped == base else clipped


def flights(family: str, depths: Sequence[int], m: int) -> list[Flight]:
    """Peak in-flight micro-batches per stage: zero-bubble schedules also hold the B-to-W
    tensors of the weight gradients they defer (stage s defers s of them)."""
    if family == "zb-h1":
        return [Flight(full=d, after_b=min(s, m)) for s, d in enumerate(depths)]
    return [Flight(full=d) for d in depths]


# --- splits -------------------------------------------------------------------------------------
def speed_split(model: ModelSpec, stage_speed: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage in proportion to each stage's speed, at least one each (largest
    remainder first)."""
    stages = len(stage_speed)
    if stages > model.num_layers:
        raise MedleyInputError(
            f"{stages} stages need at least {stages} layers; {model.name} has {model.num_layers}"
        )
    total_speed = sum(stage_speed)
    ideal = [model.num_layers * s / total_speed for s in stage_speed]
    split = [max(1, int(x)) for x in ideal]
    while sum(split) < model.num_layers:
        gaps = [ideal[i] - split[i] for i in range(stages)]
        split[gaps.index(max(gaps))] += 1
    while sum(split) > model.num_layers:
        movable = [i for i in range(stages) if split[i] > 1]
        split[max(movable, key=lambda i: split[i] - ideal[i])] -= 1
    return tuple(split)


def uniform_split(model: ModelSpec, stages: int) -> tuple[int, ...]:
    """As even a split as the layer count allows."""
    return speed_split(model, [1.0] * stages)


def uniform(setting: Setting) -> tuple[int, ...]:
    """Split rule: every stage alike (what a homogeneous planner does)."""
    return uniform_split(setting.ctx.model, setting.num_stages)


def by_stage_capacity(setting: Setting) -> tuple[int, ...]:
    """Split rule: layers in proportion to each stage's compute capacity, the sum of its
    members' speeds (Metis splits the data inside a stage by speed)."""
    ctx, st = setting.ctx, setting.structure
    mbs = st.micro_batch_size
    names = [[ctx.cluster.devices[st.assignment[r][k]].type.name for k in range(st.pp)] for r in range(st.dp)]
    speed = {t: 1.0 / ctx.table(t, mbs).total[-1] for row in names for t in row}
    return speed_split(ctx.model, [sum(speed[names[r][k]] for r in range(st.dp)) for k in range(st.pp)])


def bottleneck(setting: Setting) -> tuple[int, ...] | None:
    """Split rule: the bottleneck sweep over the stages, each stage bounded by its devices' time
    and memory under the cheapest option first, then under any option."""
    ctx, st, dtype, depth = setting.ctx, setting.structure, setting.dtype, setting.flights
    mbs, pp, dp = st.micro_batch_size, st.pp, st.dp
    stage_types = [setting.stage_types(s) for s in range(pp)]
    types = ctx.cluster.device_types()
    caps = {t: types[t].memory_bytes * (1.0 - ctx.headroom) for sig, _ in setting.signatures for t in sig}
    ladder = memory_options(dp)
    num_layers = ctx.model.num_layers
    slowest = max(
        ctx.table(t, mbs).time(0, num_layers, recompute=True) * c
        for s in range(pp)
        for t, c in stage_types[s]
    )
    # The continuous optimum (stage s takes the share of the model its speed allows) is a lower
    # bound on the bottleneck.
    ideal = 1.0 / sum(
        1.0 / max(ctx.table(t, mbs).total[-1] * c for t, c in stage_types[s]) for s in range(pp)
    )
    for allowed in (ladder[:1], ladder):
        # Per stage and option: [(time prefix, micro-batches, memory prefix, capacity, table)], so
        # that a probe is a few bisections.
        plans = [
            [
                (
                    option,
                    [
                        (
                            ctx.table(t, mbs, dtype).total_rc
                            if option.recompute
                            else ctx.table(t, mbs, dtype).total,
                            c,
                            ctx.memory_prefix(t, mbs, dtype, option, dp, depth[s]),
                            caps[t],
                            ctx.table(t, mbs, dtype),
                        )
                        for t, c in stage_types[s]
                    ],
                )
                for option in allowed
            ]
            for s in range(pp)
        ]

        def stage_end(s: int, i: int, t: float, plans: list[Any] = plans) -> int:
            best = i
            for option, items in plans[s]:
                end = num_layers
                for times, c, memory, cap, _ in items:
                    end = min(
                        end,
                        bisect_right(times, times[i] + t / c) - 1,
                        bisect_right(memory, memory[i] + cap) - 1,
                    )
                if option.streams and end - i < option.buckets:  # short stages gather a larger share
                    for _, _, _, cap, table in items:
                        while (
                            end > i
                            and stage_memory(table, i, end, option=option, dp=dp, in_flight=depth[s]) > cap
                        ):
                            end -= 1
                best = max(best, end)
            return best

        found = bottleneck_split(
            num_layers,
            pp,
            stage_end,
            lo=ideal * SWEEP_LOW,
            hi=ideal * SWEEP_HIGH,
            fallback_hi=slowest * SWEEP_FALLBACK,
        )
        if found is not None:
            return found[0]
    return None


def interleaved_chunks(setting: Setting) -> tuple[int, ...] | None:
    """Split rule for interleaved 1F1B: chunk c runs on rank c % pp; the bottleneck sweep over the
    chunks in pipeline order, by time only (each rank's memory is the memory rule's)."""
    ctx, st, dtype = setting.ctx, setting.structure, setting.dtype
    mbs, stages = st.micro_batch_size, setting.num_stages
    chunk_types = [setting.stage_types(c) for c in range(stages)]
    slowest = max(ctx.table(t, mbs).total[-1] * n for c in range(stages) for t, n in chunk_types[c])

    def stage_end(s: int, i: int, t: float) -> int:
        return min(ctx.table(ty, mbs, dtype).max_end(i, t / n) for ty, n in chunk_types[s])

    found = bottleneck_split(ctx.model.num_layers, stages, stage_end, lo=0.0, hi=slowest * SWEEP_FALLBACK)
    return None if found is None else found[0]


# --- memory -------------------------------------------------------------------------------------
def cheapest_per_stage(setting: Setting, split: tuple[int, ...]) -> StagePlan | None:
    """Memory rule: each stage takes the cheapest option of :func:`memory_options` under which it
    fits every device type that runs it."""
    ctx, st, dtype = setting.ctx, setting.structure, setting.dtype
    mbs, dp = st.micro_batch_size, st.dp
    types = ctx.cluster.device_types()
    ladder = memory_options(dp)
    options = []
    start = 0
    for s, n in enumerate(split):
        stage_types = [t for t, _ in setting.stage_types(s)]
        fit = next(
            (
                o
                for o in ladder
                if all(
                    stage_memory(
                        ctx.table(t, mbs, dtype),
                        start,
                        start + n,
                        option=o,
                        dp=dp,
                        in_flight=setting.flights[s],
                    )
                    <= types[t].memory_bytes * (1.0 - ctx.headroom)
                    for t in stage_types
                )
            ),
            None,
        )
        if fit is None:
            return None
        options.append(fit)
        start += n
    return StagePlan(stage_layers=split, options=tuple(options))


def cheapest_per_rank(setting: Setting, split: tuple[int, ...]) -> StagePlan | None:
    """Memory rule for interleaved 1F1B: every chunk of a rank takes the cheapest option under
    which all of them fit at Megatron's warm-up depth, 2(p-k-1) + (v-1)·min(m, p) + 1 chunks."""
    ctx, st, dtype, v = setting.ctx, setting.structure, setting.dtype, setting.virtual_stages
    mbs, pp, dp, stages = st.micro_batch_size, st.pp, st.dp, setting.num_stages
    m = max(setting.counts)
    ladder = memory_options(dp)
    options: list[MemoryOption | None] = [None] * stages
    starts = [sum(split[:c]) for c in range(stages)]
    for rank in range(pp):
        chunks = [c for c in range(stages) if c % pp == rank]
        depth = min(m * v, 2 * (pp - rank - 1) + (v - 1) * min(m, pp) + 1)
        types = {sig[rank] for sig, _ in setting.signatures}
        cap = {
            t: min(
                ctx.capacity(row[rank])
                for row in st.assignment
                if ctx.cluster.devices[row[rank]].type.name == t
            )
            for t in types
        }

        def fits(
            option: MemoryOption,
            chunks: list[int] = chunks,
            depth: int = depth,
            types: set[str] = types,
            cap: dict[str, float] = cap,
        ) -> bool:
            return all(
                sum(
                    stage_memory(
                        ctx.table(t, mbs, dtype),
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

        fit = next((o for o in ladder if fits(o)), None)
        if fit is None:
            return None
        for c in chunks:
            options[c] = fit
    return StagePlan(stage_layers=split, options=tuple(o for o in options if o is not None))


def _one_f_one_b_flight(setting: Setting, stage: int) -> int:
    """1F1B's in-flight micro-batches at ``stage`` with the most micro-batches of any replica."""
    return min(setting.structure.pp - stage, max(setting.micro_batches))


def first_uniform_fit(choices: Sequence[MemoryOption], *, device_type: str, capacity: float) -> MemoryRule:
    """Memory rule: the first of ``choices`` under which every stage fits, every device seen as
    ``device_type`` with ``capacity`` bytes (a homogeneous planner's view of a mixed cluster)."""

    def rule(setting: Setting, split: tuple[int, ...]) -> StagePlan | None:
        table = setting.ctx.table(device_type, setting.structure.micro_batch_size)
        starts = [sum(split[:s]) for s in range(len(split))]
        for option in choices:
            if all(
                stage_memory(
                    table,
                    starts[s],
                    starts[s] + split[s],
                    option=option,
                    dp=setting.structure.dp,
                    in_flight=_one_f_one_b_flight(setting, s),
                )
                <= capacity
                for s in range(len(split))
            ):
                return StagePlan(stage_layers=split, options=(option,) * len(split))
        return None

    return rule


def rebalanced_uniform_fit(choices: Sequence[MemoryOption]) -> MemoryRule:
    """Memory rule as Metis' LayerLoadBalancer: for each of ``choices`` in turn, move layers off
    stages short of memory to the neighbour with the most room; the first option under which
    every stage then fits is every stage's."""

    def rule(setting: Setting, split_in: tuple[int, ...]) -> StagePlan | None:
        ctx, st = setting.ctx, setting.structure
        mbs, pp, dp = st.micro_batch_size, st.pp, st.dp
        names = [[ctx.cluster.devices[st.assignment[r][k]].type.name for k in range(pp)] for r in range(dp)]
        caps = [min(ctx.capacity(st.assignment[r][k]) for r in range(dp)) for k in range(pp)]
        split = list(split_in)

        def memory(k: int, option: MemoryOption) -> float:
            start = sum(split[:k])
            return max(
                stage_memory(
                    ctx.table(t, mbs),
                    start,
                    start + split[k],
                    option=option,
                    dp=dp,
                    in_flight=_one_f_one_b_flight(setting, k),
                )
                for t in {names[r][k] for r in range(dp)}
            )

        for option in choices:
            for _ in range(4 * ctx.model.num_layers):
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
                return StagePlan(stage_layers=tuple(split), options=(option,) * pp)
        return None

    return rule


def fixed(option: MemoryOption) -> MemoryRule:
    """Memory rule: ``option`` on every stage, fitting or not (the caller judges)."""
    return lambda setting, split: StagePlan(stage_layers=split, options=(option,) * len(split))


# --- estimates ------------------------------------------------------------------------------------
def analytic(setting: Setting, plan: StagePlan) -> float:
    """:func:`medley.plan.step_estimate.step_estimate`."""
    return step_estimate(
        setting.ctx,
        setting.structure,
        setting.family,
        plan.stage_layers,
        plan.options,
        setting.micro_batches,
        setting.signatures,
        setting.virtual_stages,
    )


def homogeneous_1f1b(device_type: str) -> EstimateRule:
    """1F1B's pipeline time with every stage on ``device_type``, no transfers and no weight
    gradients deferred (a homogeneous planner's own view)."""

    def rule(setting: Setting, plan: StagePlan) -> float:
        table = setting.ctx.table(device_type, setting.structure.micro_batch_size)
        split, pp = plan.stage_layers, len(plan.stage_layers)
        starts = [sum(split[:s]) for s in range(pp)]
        times = [
            table.time(starts[s], starts[s] + split[s], recompute=plan.options[s].recompute)
            for s in range(pp)
        ]
        return pipeline_time(
            "1f1b",
            stage_times=times,
            stage_weight_times=[0.0] * pp,
            link_times=[],
            micro_batches=max(setting.micro_batches),
        )

    return rule


def no_estimate(setting: Setting, plan: StagePlan) -> float:
    return 0.0


# --- the builder ----------------------------------------------------------------------------------
def build(
    ctx: PlanContext,
    structure: Structure,
    family: str,
    *,
    split: SplitRule,
    memory: MemoryRule,
    micro_batches: MicroBatchRule,
    estimate: EstimateRule = analytic,
    virtual_stages: int = 1,
) -> Candidate | None:
    """The candidate of ``family`` on ``structure`` under the given rules, or None when it cannot
    fit (or, for hetero-1f1b, would equal 1F1B).

    Micro-batches come first; then, for each round of the micro-batch rule, the in-flight depths
    of the family, the split and the memory options; the rule may then revise the micro-batches
    from the placed split. Raises what the cost source raises for a device type or micro-batch
    size it cannot answer (``ValueError``)."""
    st = structure
    dtype = ctx.dtype(st.assignment)
    signatures = ctx.signatures(st)
    total = ctx.global_batch // st.micro_batch_size
    counts_now = micro_batches.first(ctx, st, signatures, total)
    plan: StagePlan | None = None
    for _ in range(micro_batches.rounds):
        setting = _setting(ctx, st, family, signatures, counts_now, dtype, virtual_stages)
        if setting is None:
            return None
        stage_layers = split(setting)
        if stage_layers is None:
            return None
        plan = memory(setting, stage_layers)
        if plan is None:
            return None
        new = counts_now if micro_batches.refine is None else micro_batches.refine(setting, plan)
        if new == counts_now:
            break
        counts_now = new
    assert plan is not None
    final = _setting(ctx, st, family, signatures, counts_now, dtype, virtual_stages, depths_required=False)
    assert final is not None
    knobs: dict[str, Any] = {}
    if family == "hetero-1f1b":
        depths = warmup_depths(ctx, st, family, max(final.counts), signatures)
        knobs = {"warmup": list(depths or ())}
    elif family == "interleaved":
        knobs = {"virtual_stages": virtual_stages}
    return Candidate(
        structure=st,
        family=family,
        knobs=knobs,
        micro_batches=counts_now,
        stage_layers=plan.stage_layers,
        options=plan.options,
        estimate_s=estimate(final, plan),
        dtype=dtype,
    )


def _setting(
    ctx: PlanContext,
    st: Structure,
    family: str,
    signatures: Signatures,
    micro_batches: tuple[int, ...],
    dtype: str,
    virtual_stages: int,
    *,
    depths_required: bool = True,
) -> Setting | None:
    counts = [micro_batches[members[0]] for _, members in signatures]
    depths = warmup_depths(ctx, st, family, max(counts), signatures)
    if depths is None and depths_required:
        return None
    return Setting(
        ctx=ctx,
        structure=st,
        family=family,
        signatures=signatures,
        micro_batches=micro_batches,
        counts=counts,
        flights=flights(family, depths or (), max(counts)),
        dtype=dtype,
        virtual_stages=virtual_stages,
    )
