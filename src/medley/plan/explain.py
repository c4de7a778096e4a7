"""Why the best plan wins (``medley plan --explain``), and why nothing fits when nothing does.

:func:`explain` names the bottleneck device (the busiest), what limited memory (the device with
the least headroom and the option its stage needed), and what each knob bought: the best plan is
re-simulated with one knob at a time set back to a plain choice (1F1B, a speed-proportional
split, equal micro-batches, ZeRO-1 everywhere, no recomputation, naive ZeRO placement) and the
step-time difference is reported. Every figure is a simulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from medley.cost import formulas
from medley.errors import MedleyInputError
from medley.plan.bounds import MemoryOption, stage_memory
from medley.plan.candidates import Estimator
from medley.plan.inline import balanced_split
from medley.plan.layout import PlanLayout
from medley.plan.predict import predict
from medley.plan.ranking import rank_plan
from medley.plan.space import PP_CHOICES, Candidate, Structure
from medley.schedule.zero import Placement, StageZero

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

    def lines(self) -> list[str]:
        out = [
            f"Bottleneck: device {self.bottleneck_device} ({self.bottleneck_type}) computes "
            f"{self.bottleneck_busy:.0%} of the step; the split and micro-batch counts balance the others "
            "to it.",
            f"Memory: device {self.tightest_device} ({self.tightest_type}) has the least headroom, "
            f"{self.tightest_headroom_gb:.1f} GB; its stage runs {self.tightest_stage_option}.",
        ]
        for k in self.knobs:
            if k.step_time_s is None:
                out.append(f"{k.knob}: {k.chosen}; with {k.alternative} the plan would not fit or run.")
            else:
                change = (k.slowdown or 1.0) - 1.0
                out.append(
                    f"{k.knob}: {k.chosen}; with {k.alternative} the step takes {k.step_time_s:.3f} s "
                    f"({change:+.1%})."
                )
        for name, ratio in self.versus_baselines.items():
            out.append(
                f"vs {name}: " + ("baseline finds no plan that fits" if ratio is None else f"{ratio:.2f}x")
            )
        out.append(f"Fraction of the aggregate bound: {self.aggregate_fraction:.0%}.")
        return out


def _option_text(zero: StageZero, recompute: bool) -> str:
    level = "streamed ZeRO-3" if zero.streams else f"ZeRO-{zero.level}"
    return level + (" with recomputation" if recompute else "")


def _variants(layout: PlanLayout, result) -> list[tuple[str, str, str, PlanLayout]]:
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
    even = balanced_split(layout.model, [1.0] * chain)
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
                str(list(layout.recompute)),
                "none",
                replace(layout, recompute=(False,) * layout.num_stages),
            )
        )
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


def _fold_rc(layout: PlanLayout) -> tuple[bool, ...]:
    return layout.recompute[: layout.pp] if layout.schedule == "interleaved" else layout.recompute


def explain(search_result) -> Explanation:
    """Explain ``search_result.best`` (a :class:`~medley.plan.search.SearchResult`)."""
    best = search_result.best
    layout, cluster, result = best.plan.layout, search_result.cluster, best.result
    busiest = max(result.devices, key=lambda r: (r.busy_fraction, -r.device))
    headroom = {
        r.device: cluster.devices[r.device].type.memory_bytes - r.peak_memory_bytes for r in result.devices
    }
    tight = min(headroom, key=lambda d: (headroom[d], d))
    s2r = result.devices and layout.assignment
    rank = next(k for row in s2r for k, d in enumerate(row) if d == tight)
    stage = next(s for s in range(layout.num_stages) if s % layout.pp == rank)
    knobs = []
    for knob, chosen, alternative, variant in _variants(layout, result):
        try:
            prediction, _, sim = predict(variant, cluster, cost=search_result.cost)
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
            layout.zero[stage], bool(layout.recompute and layout.recompute[stage])
        ),
        knobs=knobs,
        versus_baselines=versus,
        aggregate_fraction=best.tokens_per_s / search_result.aggregate_tokens_per_s,
    )


def _frugal_candidate(estimator: Estimator, devices: list[int], max_pp: int, mbs: int) -> Candidate:
    """The least memory per device medley can offer on ``devices``: streamed ZeRO-3 (when
    replicated) and recomputation everywhere, the smallest micro-batch, an even split, at the
    pipeline depth whose estimated worst overshoot is smallest."""
    model = estimator.model
    order = sorted(devices, key=lambda d: (-estimator.cluster.devices[d].type.memory_bytes, d))
    total = estimator.global_batch // mbs
    best: tuple[float, int, Candidate] | None = None
    for pp in (p for p in PP_CHOICES if p <= min(max_pp, len(devices), model.num_layers)):
        dp = max(1, min(len(devices) // pp, total))
        assignment = estimator.assign(order, pp, dp, "stage-major")
        split = balanced_split(model, [1.0] * pp)
        option = MemoryOption(level=3 if dp > 1 else 0, buckets=8, recompute=True)
        counts = tuple(total // dp + (1 if r < total % dp else 0) for r in range(dp))
        overshoot = max(
            stage_memory(
                estimator.table(estimator.cluster.devices[assignment[0][s]].type.name, mbs),
                sum(split[:s]),
                sum(split[: s + 1]),
                option=option,
                dp=dp,
                in_flight=min(pp - s, max(counts)),
            )
            - estimator.capacity(assignment[0][s])
            for s in range(pp)
        )
        structure = Structure(
            pool="frugal", strategy="memory-first", pp=pp, dp=dp, assignment=assignment, micro_batch_size=mbs
        )
        candidate = Candidate(
            structure=structure,
            family="1f1b",
            micro_batches=counts,
            stage_layers=split,
            options=(option,) * pp,
            estimate_s=0.0,
            dtype=estimator.dtype(assignment),
        )
        if best is None or overshoot < best[0]:
            best = (overshoot, pp, candidate)
    assert best is not None
    return best[2]


def shortfall_error(
    estimator: Estimator,
    ranked: Sequence,
    pools: dict[str, list[int]],
    constraints,
    global_batch: int,
    sizes: Sequence[int],
) -> MedleyInputError:
    """The error for "the model fits nowhere": the smallest shortfall, where, and what would close it."""
    cluster, model = estimator.cluster, estimator.model
    tried = list(ranked)
    max_pp = constraints.max_pp or model.num_layers
    frugal = _frugal_candidate(estimator, pools["all"], max_pp, min(sizes))
    try:
        tried.append(
            rank_plan(
                frugal,
                frugal.layout(model, estimator.seq_len),
                cluster,
                estimator.cost,
                constraints.memory_headroom,
            )
        )
    except MedleyInputError:
        pass
    if not tried:
        return MedleyInputError(f"{model.name}: no plan could be built on cluster '{cluster.name}'.")
    closest = max(tried, key=lambda p: (p.min_headroom_gb, -tried.index(p)))
    report = min(
        closest.result.devices,
        key=lambda r: (
            cluster.devices[r.device].type.memory_bytes * (1 - constraints.memory_headroom)
            - r.peak_memory_bytes,
            r.device,
        ),
    )
    device = cluster.devices[report.device]
    short_gb = -closest.min_headroom_gb
    lay = closest.plan.layout
    hints = []
    if constraints.max_pp is not None and constraints.max_pp < min(len(pools["all"]), model.num_layers):
        hints.append(f"raise --max-pp above {constraints.max_pp} (more stages, fewer layers each)")
    if constraints.memory_headroom > 0 and short_gb < device.type.memory_gb * constraints.memory_headroom:
        hints.append(f"lower --memory-headroom (now {constraints.memory_headroom:.0%})")
    if constraints.exclude_devices:
        hints.append("stop excluding devices with --exclude-devices (more devices shard ZeRO state further)")
    state_gb = 16.0 * formulas.total_params(model) / GB
    total_gb = sum(cluster.devices[d].type.memory_gb for d in pools["all"])
    hints.append(f"a shorter --seq-len than {estimator.seq_len} (activations grow with it)")
    if state_gb > 0.5 * total_gb:
        hints.append(
            f"more or larger devices: weights, gradients and Adam state alone take {state_gb:,.0f} GB "
            f"against {total_gb:,.0f} GB on the devices planned on"
        )
    else:
        hints.append("devices with more memory for the first stages (they hold the most activations)")
    levels = sorted({"streamed ZeRO-3" if z.streams else f"ZeRO-{z.level}" for z in lay.zero})
    zero = " / ".join(levels)
    return MedleyInputError(
        f"{model.name} fits nowhere on cluster '{cluster.name}' at --global-batch {global_batch}, --seq-len "
        f"{estimator.seq_len}: the closest plan (pp={lay.pp}, dp={lay.dp}, micro-batch size "
        f"{lay.micro_batch_size}, {zero}, recompute {'on' if all(lay.recompute) else 'off'}) is "
        f"{short_gb:.1f} GB short on device {report.device} ({device.type.name}, "
        f"{device.type.memory_gb:g} GB, "
        f"{constraints.memory_headroom:.0%} kept free). Knobs that would close it: " + "; ".join(hints) + "."
    )
