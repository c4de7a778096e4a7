"""Why the best plan wins (``medley plan --explain``); why nothing fits, when nothing does, is
:mod:`medley.search.rank.shortfall`'s.

:func:`explain` names the bottleneck device (the busiest), what limited memory (the device with
the least headroom and the option its stage needed), and what each knob bought: the best plan is
re-simulated with one knob at a time set back to a plain choice (1F1B, a speed-proportional
split, equal micro-batches, ZeRO-1 everywhere, no recomputation, naive ZeRO placement) and the
step-time difference is reported. Every figure is a simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from itertools import islice

from medley.cost.recompute import Recompute, recompute_text
from medley.errors import MedleyInputError
from medley.lowering.predict import predict_groups
from medley.plan.layout import PlanLayout, uniform_split
from medley.schedule.zero_settings import Placement, StageZero
from medley.search.planner import SearchResult
from medley.search.rank.ranking import RankedPlan, simulate_all
from medley.sim.result import SimResult
from medley.spec.catalog import lacking_bf16, precision_reason
from medley.spec.cluster import Cluster

GB = 1e9
# How the explanation names each ZeRO placement policy (the plan file writes the enum value).
PLACEMENT_NAMES = {Placement.NAIVE: "naive", Placement.BUBBLE: "bubble-aware"}


@dataclass(frozen=True, kw_only=True)
class KnobEffect:
    """The best plan with one knob set back, and what that costs."""

    knob: str
    chosen: str
    alternative: str
    step_time_s: float | None  # None: the alternative does not fit in memory or is not valid
    slowdown: float | None  # alternative step time / chosen step time


@dataclass(frozen=True, kw_only=True)
class Explanation:
    bottleneck_device: int
    bottleneck_type: str
    bottleneck_busy: float
    tightest_device: int
    tightest_type: str
    tightest_headroom_gb: float
    tightest_stage_option: str
    knobs: list[KnobEffect]
    versus_baselines: dict[str, float | None]
    aggregate_fraction: float
    precision: str
    left_out: list[str] = field(default_factory=list)  # devices idle, bf16 forgone: :func:`left_out`

    def lines(self) -> list[str]:
        out = [
            f"Bottleneck: device {self.bottleneck_device} ({self.bottleneck_type}) computes "
            f"{self.bottleneck_busy:.0%} of the step; the split and micro-batch counts balance the others "
            "to it.",
            f"Memory: device {self.tightest_device} ({self.tightest_type}) has the least headroom, "
            f"{self.tightest_headroom_gb:.1f} GB; its stage runs {self.tightest_stage_option}.",
            f"Precision: {self.precision}.",
            *self.left_out,
        ]
        for k in self.knobs:
            if k.step_time_s is None:
                out.append(f"{k.knob}: {k.chosen}; with {k.alternative} the plan would not fit or run.")
            else:
                change = (k.slowdown or 1.0) - 1.0
                if abs(change) < 0.0005:  # "+0.0%" said nothing
                    effect = f"{k.alternative} gives the same step ({k.step_time_s:.3f} s)"
                elif change < 0:  # the search ranks whole plans; say so rather than hide it
                    effect = (f"with {k.alternative} the step would take {k.step_time_s:.3f} s, "
                              f"{-change:.1%} less (a variant the search did not simulate)")
                else:
                    effect = f"with {k.alternative} the step takes {k.step_time_s:.3f} s ({change:+.1%})"
                out.append(f"{k.knob}: {k.chosen}; {effect}.")
        for name, ratio in self.versus_baselines.items():
            out.append(
                f"vs {name}: " + ("baseline finds no plan that fits" if ratio is None else f"{ratio:.2f}x")
            )
        out.append(f"Fraction of the aggregate bound: {self.aggregate_fraction:.0%}.")
        return out


def _option_text(zero: StageZero, recompute: Recompute) -> str:
    level = "streamed ZeRO-3" if zero.streams else f"ZeRO-{zero.level}"
    return level + (f" with {recompute_text(recompute)}" if recompute else "")


def _variants(layout: PlanLayout, result: SimResult) -> list[tuple[str, str, str, PlanLayout]]:
    """(knob, chosen, alternative, layout with that knob set back)."""
    out = []
    if layout.schedule != "1f1b":
        out.append(
            (
                "schedule",
                layout.schedule,
                "1f1b",
                replace(
                    layout,
                    schedule="1f1b",
                    knobs={},
                    stage_layers=_fold(layout),
                    zero=_fold_zero(layout),
                    recompute=_fold_rc(layout),
                ),
            )
        )
    chain = layout.pp if layout.schedule != "interleaved" else layout.num_stages
    even = uniform_split(layout.model, chain)
    if even != layout.stage_layers:
        out.append(
            (
                "split",
                str(list(layout.stage_layers)),
                f"an even split {list(even)}",
                replace(layout, stage_layers=even),
            )
        )
    if len(set(layout.micro_batches)) > 1:
        total = sum(layout.micro_batches)
        equal = tuple(total // layout.dp + (1 if r < total % layout.dp else 0) for r in range(layout.dp))
        out.append(
            (
                "micro-batches",
                str(list(layout.micro_batches)),
                f"equal counts {list(equal)}",
                replace(layout, micro_batches=equal),
            )
        )
    plain = tuple(StageZero(level=1 if layout.dp > 1 else 0, buckets=z.buckets) for z in layout.zero)
    if plain != layout.zero:
        out.append(
            (
                "ZeRO",
                str([z.level for z in layout.zero]),
                "ZeRO-1 on every stage",
                replace(layout, zero=plain),
            )
        )
    if any(layout.recompute):
        out.append(
            (
                "recomputation",
                _rc_list(layout.recompute),
                "none",
                replace(layout, recompute=(False,) * layout.num_stages),
            )
        )
    if layout.adapter is not None:  # what the adapter changed: the same plan training every weight
        lora = layout.adapter
        out.append(("adapter", f"LoRA rank {lora.rank} on {', '.join(lora.targets)} (base frozen)",
                    "full training", replace(layout, adapter=None)))
    if layout.dp > 1:
        other = Placement.BUBBLE if layout.placement is Placement.NAIVE else Placement.NAIVE
        out.append(("ZeRO placement", PLACEMENT_NAMES[layout.placement], PLACEMENT_NAMES[other],
                    replace(layout, placement=other)))
    del result
    return out


def _fold(layout: PlanLayout) -> tuple[int, ...]:
    """An interleaved split folded onto one stage per rank (for the 1F1B variant)."""
    if layout.schedule != "interleaved":
        return layout.stage_layers
    return tuple(
        sum(layout.stage_layers[s] for s in range(k, layout.num_stages, layout.pp)) for k in range(layout.pp)
    )


def _fold_zero(layout: PlanLayout) -> tuple[StageZero, ...]:
    return layout.zero[: layout.pp] if layout.schedule == "interleaved" else layout.zero


def _rc_list(settings: tuple[Recompute, ...]) -> str:
    return "[" + ", ".join(str(r) for r in settings) + "]"


def _fold_rc(layout: PlanLayout) -> tuple[Recompute, ...]:
    return layout.recompute[: layout.pp] if layout.schedule == "interleaved" else layout.recompute


def _group_variants(groups: tuple[PlanLayout, ...]) -> list[tuple[str, str, str, tuple[PlanLayout, ...]]]:
    """Replica groups of their own shape: each knob set back in every group (schedule,
    recomputation, ZeRO placement); the other knobs are the groups' own (their splits and
    micro-batches follow from their shapes and shares)."""
    out = []
    if any(g.schedule != "1f1b" for g in groups):
        folded = tuple(replace(g, schedule="1f1b", knobs={}, stage_layers=_fold(g), zero=_fold_zero(g),
                               recompute=_fold_rc(g)) for g in groups)
        out.append(("schedule", "+".join(g.schedule for g in groups), "1f1b in every group", folded))
    if any(any(g.recompute) for g in groups):
        out.append(("recomputation", "+".join(_rc_list(g.recompute) for g in groups), "none",
                    tuple(replace(g, recompute=(False,) * g.num_stages) for g in groups)))
    placement = groups[0].placement
    other = Placement.BUBBLE if placement is Placement.NAIVE else Placement.NAIVE
    out.append(("ZeRO placement", PLACEMENT_NAMES[placement], PLACEMENT_NAMES[other],
                tuple(replace(g, placement=other) for g in groups)))
    return out


def _alike_effect(search_result: SearchResult) -> KnobEffect:
    """What replicas of their own shape bought: the best plan of alike replicas the search
    simulated, against the best plan."""
    best = search_result.best
    alike = [p for p in search_result.simulated if p.fits and not p.plan.asymmetric]
    chosen = f"{len(best.plan.groups)} replica groups of their own shape"
    if not alike:
        return KnobEffect(knob="replica shapes", chosen=chosen, alternative="alike replicas",
                          step_time_s=None, slowdown=None)
    other = min(alike, key=lambda p: p.prediction.step_time_s)
    seconds = other.prediction.step_time_s
    return KnobEffect(knob="replica shapes", chosen=chosen,
                      alternative="alike replicas (the fastest such plan simulated)", step_time_s=seconds,
                      slowdown=seconds / best.prediction.step_time_s)


def _slowest_link(cluster: Cluster, devices: Iterable[int]) -> tuple[float, str] | None:
    """The slowest link between two nodes that ``devices`` span (GB/s, the tier's name); None on one
    node."""
    nodes = sorted({cluster.devices[d].node for d in devices})
    links = [(cluster.node_pair_link(a, b)[0], cluster.tiers[cluster.meeting_tier(a, b)].name)
             for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    return min(links, default=None)


def _against(other: RankedPlan, best: RankedPlan, cluster: Cluster) -> str:
    """``other``'s step against the best plan's, and where its time goes that the best's does not
    (and the slower link its devices span, where they span one)."""
    mine, theirs = best.prediction, other.prediction
    text = (f"takes {theirs.step_time_s:.3f} s ({theirs.step_time_s / mine.step_time_s - 1:+.1%}): bubble "
            f"{theirs.bubble_fraction:.0%} against {mine.bubble_fraction:.0%}, communication exposed "
            f"{theirs.exposed_comm_s:.3f} s per device against {mine.exposed_comm_s:.3f} s")
    link, own = _slowest_link(cluster, other.plan.devices), _slowest_link(cluster, best.plan.devices)
    if link is not None and (own is None or link[0] < own[0]):
        text += f"; its devices span tier '{link[1]}' ({link[0]:g} GB/s)"
        text += ", this plan's stay on one node" if own is None else f", this plan's {own[0]:g} GB/s at worst"
    return text


# Candidates simulated for a --explain line when no plan simulated by the search answers it.
EXPLAIN_SIMULATED = 3


def _fastest(search_result: SearchResult, wanted: Callable[[set[int], str], bool],
             what: str) -> tuple[RankedPlan | None, str]:
    """The fastest fitting plan ``wanted`` among those the search simulated, else among the
    EXPLAIN_SIMULATED best-estimated such candidates, simulated now; with how it was found (or,
    when none fits, why: ``what`` names such plans). ``wanted`` sees a plan's devices and dtype."""
    best = search_result.best
    found = [p for p in search_result.simulated
             if p.fits and p is not best and wanted(set(p.plan.devices), p.plan.shared.dtype)]
    if found:
        return min(found, key=lambda p: p.prediction.step_time_s), f"the fastest plan simulated {what}"
    model, seq_len = search_result.model, search_result.seq_len
    layouts = ((c, c.layout(model, seq_len)) for c in search_result.estimated)
    picked = list(islice((c for c, layout in layouts if wanted(set(layout.devices), layout.dtype)),
                         EXPLAIN_SIMULATED))
    if not picked:
        return None, (f"the search estimated no plan {what}: its bounds ruled them out (memory, or a step "
                      "no faster than those it kept)")
    ranked = [p for p in simulate_all(picked, model, seq_len, search_result.cluster, search_result.cost,
                                      search_result.constraints, pricing=search_result.pricing) if p.fits]
    if not ranked:
        return None, f"none of the {len(picked)} best-estimated plans {what} fits in memory"
    return (min(ranked, key=lambda p: p.prediction.step_time_s),
            f"the fastest of the {len(picked)} best-estimated plans {what} (simulated for this line)")


def left_out(search_result: SearchResult) -> list[str]:
    """What the best plan forgoes, each with the fastest plan that does not: the devices it leaves
    idle (and a plan that uses every device), and bf16 where a device type without it makes the
    plan fp16 (and the fastest bf16 plan, which leaves that type out)."""
    best, cluster = search_result.best, search_result.cluster
    usable = set(range(cluster.num_devices)) - set(search_result.constraints.exclude_devices)
    out = []
    idle = sorted(usable - set(best.plan.devices))
    if idle:
        names = ", ".join(f"{d} ({cluster.devices[d].type.name})" for d in idle)
        other, how = _fastest(search_result, lambda devices, _: usable <= devices,
                              "that uses every device")
        out.append(f"Idle: device{'s' if len(idle) > 1 else ''} {names} left out by this plan; {how}"
                   + (f" {_against(other, best, cluster)}." if other else "."))
    lacking = lacking_bf16(cluster.device_types(best.plan.devices).values())
    chosen = search_result.constraints.dtype is not None  # plan --dtype: nothing forgone by the devices
    if best.plan.shared.dtype == "fp16" and lacking and not chosen:
        them = "it" if len(lacking) == 1 else "them"
        other, how = _fastest(search_result, lambda _, dtype: dtype == "bf16", f"in bf16 (without {them})")
        where = f", on {len(other.plan.devices)} devices, {_against(other, best, cluster)}" if other else ""
        out.append(f"bf16: {', '.join(lacking)} made this plan fp16; {how}{where}.")
    return out


def explain(search_result: SearchResult) -> Explanation:
    """Explain ``search_result.best``."""
    best = search_result.best
    groups, cluster, result = best.plan.groups, search_result.cluster, best.result
    busiest = max(result.devices, key=lambda r: (r.busy_fraction, -r.device))
    headroom = {
        r.device: cluster.devices[r.device].type.memory_bytes - r.peak_memory_bytes for r in result.devices
    }
    tight = min(headroom, key=lambda d: (headroom[d], d))
    layout, rank = next((g, k) for g in groups for r in range(g.dp) for k in range(g.pp)
                        if tight in g.group(r, k))
    stage = next(s for s in range(layout.num_stages) if s % layout.pp == rank)
    variants = ([(knob, chosen, alternative, (variant,)) for knob, chosen, alternative, variant
                 in _variants(groups[0], result)] if len(groups) == 1 else _group_variants(groups))
    knobs = [] if len(groups) == 1 else [_alike_effect(search_result)]
    for knob, chosen, alternative, variant in variants:
        try:
            prediction, _, sim = predict_groups(variant, cluster, cost=search_result.cost,
                                                pricing=search_result.pricing)
        except (MedleyInputError, ValueError):
            knobs.append(
                KnobEffect(knob=knob, chosen=chosen, alternative=alternative, step_time_s=None, slowdown=None)
            )
            continue
        fits = all(
            r.peak_memory_bytes
            <= cluster.devices[r.device].type.memory_bytes * (1 - search_result.constraints.memory_headroom)
            for r in sim.devices
        )
        knobs.append(
            KnobEffect(
                knob=knob,
                chosen=chosen,
                alternative=alternative + ("" if fits else " (does not fit in memory)"),
                step_time_s=prediction.step_time_s,
                slowdown=prediction.step_time_s / best.prediction.step_time_s,
            )
        )
    versus = {
        name: (None if b is None else best.tokens_per_s / b.tokens_per_s)
        for name, b in search_result.baselines.items()
    }
    return Explanation(
        bottleneck_device=busiest.device,
        bottleneck_type=cluster.devices[busiest.device].type.name,
        bottleneck_busy=busiest.busy_fraction,
        tightest_device=tight,
        tightest_type=cluster.devices[tight].type.name,
        tightest_headroom_gb=headroom[tight] / GB,
        tightest_stage_option=_option_text(
            layout.zero[stage], layout.stage_recompute(stage)
        ),
        knobs=knobs,
        versus_baselines=versus,
        aggregate_fraction=best.tokens_per_s / search_result.aggregate_tokens_per_s,
        precision=precision_reason(best.plan.shared.dtype, cluster.device_types(best.plan.devices).values()),
        left_out=left_out(search_result),
    )
