"""One way to turn a structure into a candidate: :func:`build`, configured by small rules.

A candidate is a structure (devices and their roles) plus a schedule family, micro-batches per
replica, a layer split and a memory option per stage, and an analytic step estimate. :func:`build`
fixes the order in which those are chosen; the rules say how:

* micro-batches (:class:`MicroBatchRule`): :func:`balanced_micro_batches` (by replica speed, then
  once more from the split's bottlenecks), :func:`by_replica_speed`, :func:`equal_micro_batches`,
  :func:`given_micro_batches`;
* the split (:data:`SplitRule`, in :mod:`medley.search.rules.split_rules`): ``bottleneck`` (the fastest
  split under each device's memory), ``interleaved_chunks`` (over the chunks of interleaved 1F1B,
  time only), ``uniform`` (Megatron), ``by_stage_capacity`` (Metis);
* memory (:data:`MemoryRule`, in :mod:`medley.search.rules.memory_rules`): ``cheapest_per_stage``,
  ``cheapest_per_rank`` (every chunk of a rank alike), ``first_uniform_fit`` (one option for
  every stage), ``rebalanced_uniform_fit`` (Metis' layer load balancer), ``fixed``;
* the estimate (:data:`EstimateRule`): :func:`analytic` (:mod:`medley.search.estimate.step_estimate`),
  :func:`homogeneous_1f1b`, :func:`no_estimate`.

The planner's own candidates (:class:`~medley.search.rules.candidates.Estimator`), the baselines
(:mod:`medley.search.rank.baselines`) and the least-memory plan behind "fits nowhere"
(:mod:`medley.search.rank.shortfall`) are configurations of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from medley.schedule.generators.classic import one_f_one_b_depth
from medley.search.estimate.bounds import Flight, memory_options, pipeline_time
from medley.search.estimate.context import PlanContext, Signatures
from medley.search.estimate.layer_table import LayerTable
from medley.search.estimate.step_estimate import step_estimate
from medley.search.space import Candidate, MemoryOption, Structure, distribute


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What the split and memory rules see for one structure, family and micro-batch count.

    Attributes:
        ctx: the planning context; structure, family: what is being built.
        signatures: replicas grouped by the device types of their ranks.
        micro_batches: per replica; counts: per signature (its first replica's).
        flights: in-flight micro-batches per stage at the family's warm-up depths.
        dtype: training precision; virtual_stages: chunks per rank (interleaved 1F1B).
        ladder: the memory options stages may take, least memory-saving first.
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
    ladder: tuple[MemoryOption, ...]

    @property
    def num_stages(self) -> int:
        return self.structure.pp * self.virtual_stages

    def stage_tp(self, stage: int) -> int:
        """Tensor-parallel degree of ``stage`` (its pipeline rank's)."""
        return self.structure.tp_of(stage % self.structure.pp)

    def table(self, stage: int, device_type: str) -> LayerTable:
        """The layer table of ``stage`` on ``device_type`` at the setting's dtype and the stage's tp."""
        return self.ctx.table(device_type, self.structure.micro_batch_size, self.dtype, self.stage_tp(stage))

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
    weights = [1.0 / sum(ctx.table(t, mbs, tp=st.tp_of(k)).total[-1] for k, t in enumerate(sig))
               for sig, _ in signatures]
    return ctx.micro_batches(st, signatures, weights, total)


def _bottleneck_weights(setting: Setting, plan: StagePlan) -> tuple[int, ...]:
    ctx, st = setting.ctx, setting.structure
    mbs, split, options = st.micro_batch_size, plan.stage_layers, plan.options
    bottlenecks = [
        max(ctx.stage_time(sig[s], split, s, options[s], mbs, st.tp_of(s)) for s in range(st.pp))
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
        names = [[(ctx.cluster.devices[d].type.name, st.tp_of(k)) for k, d in enumerate(row)]
                 for row in st.assignment]
        speed = {(t, tp): 1.0 / ctx.table(t, mbs, tp=tp).total[-1] for row in names for t, tp in row}
        return distribute(total, [1.0 / max(1.0 / speed[key] for key in row) for row in names])

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
    base = tuple(one_f_one_b_depth(pp, s, m) for s in range(pp))
    if family != "hetero-1f1b":
        return base
    mbs = st.micro_batch_size
    t_stage = max(ctx.table(t, mbs, tp=st.tp_of(k)).total[-1] for sig, _ in signatures
                  for k, t in enumerate(sig)) / pp
    depths = [1] * pp
    for s in range(pp - 2, -1, -1):
        link = max(ctx.boundary_time(r[s], r[s + 1], mbs, st.tp_of(s), st.tp_of(s + 1))
                   for r in st.assignment)
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


# --- estimates ------------------------------------------------------------------------------------
def analytic(setting: Setting, plan: StagePlan) -> float:
    """:func:`medley.search.estimate.step_estimate.step_estimate`."""
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
        split, pp = plan.stage_layers, len(plan.stage_layers)
        starts = [sum(split[:s]) for s in range(pp)]
        times = [
            setting.ctx.table(device_type, setting.structure.micro_batch_size, tp=setting.stage_tp(s))
            .time(starts[s], starts[s] + split[s], recompute=plan.options[s].recompute)
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
    replicated_level: int = 0,
    dtype: str | None = None,
) -> Candidate | None:
    """The candidate of ``family`` on ``structure`` under the given rules, or None when it cannot
    fit (or, for hetero-1f1b, would equal 1F1B).

    Micro-batches come first; then, for each round of the micro-batch rule, the in-flight depths
    of the family, the split and the memory options; the rule may then revise the micro-batches
    from the placed split. Raises what the cost source raises for a device type or micro-batch
    size it cannot answer (``ValueError``). ``replicated_level``: where the memory ladder of
    replicated stages starts (:func:`~medley.search.estimate.bounds.memory_options`); ``dtype``: the
    precision (default: the structure's devices', :meth:`PlanContext.dtype`; a replica group of a
    plan with others takes the plan's)."""
    st = structure
    dtype = dtype or ctx.dtype(st.assignment)
    signatures = ctx.signatures(st)
    total = ctx.global_batch // st.micro_batch_size
    counts_now = micro_batches.first(ctx, st, signatures, total)
    plan: StagePlan | None = None
    for _ in range(micro_batches.rounds):
        setting = _setting(ctx, st, family, signatures, counts_now, dtype, virtual_stages, replicated_level)
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
    final = _setting(ctx, st, family, signatures, counts_now, dtype, virtual_stages, replicated_level,
                     depths_required=False)
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
        adapter=ctx.adapter,
    )


def _setting(
    ctx: PlanContext,
    st: Structure,
    family: str,
    signatures: Signatures,
    micro_batches: tuple[int, ...],
    dtype: str,
    virtual_stages: int,
    replicated_level: int,
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
        ladder=memory_options(st.zero_dp, replicated_level=replicated_level),
    )
