"""The fidelity loop: profile, simulate, run for real, compare step time and peak memory.

For each :class:`FidelityCase` (a plan on an emulated CPU cluster, see :mod:`medley.fidelity.emulate`)
the simulator predicts one step from the measured profile, then medley's runtime trains the same
plan on this machine (gloo, one rank per device, emulation on) and reports step time (median over
the steps after warm-up, max over ranks) and peak live tensor bytes per rank (the runtime's
live-tensor probe step, :mod:`medley.runtime.memory`). Errors are (predicted - measured) / measured.
A case is either written out (pp, dp, schedule, split, ZeRO, ...) or taken from ``medley plan``'s
ranking on its emulated cluster (``from_planner``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medley.cost.profile_format import Profile
from medley.fidelity.emulate import EmulatedCluster, core_share, emulated_cluster
from medley.fidelity.replay import MeasuredStep, replay_steps
from medley.fidelity.results import (
    FidelityResult,
    busy_seconds,
    memory_failure,
    summarize,
    timing_failure,
)
from medley.lowering.predict import predict_groups
from medley.plan.inline import devices_needed, inline_layout, parse_tp
from medley.plan.layout import PlanLayout
from medley.plan.plan import Plan
from medley.plan.segments import joined
from medley.profile.cpu_load import cpu_meter
from medley.schedule.ir import Kind
from medley.sim.problem import SimProblem
from medley.sim.result import SimResult
from medley.spec.model import ModelSpec

if TYPE_CHECKING:
    from medley.runtime.records import StepRecord

__all__ = [
    "FidelityCase",
    "FidelityResult",
    "build_plan",
    "NotRanked",
    "case_groups",
    "describe",
    "emulate",
    "memory_failure",
    "run_case",
    "summarize",
    "tags",
    "timing_failure",
]

PLANNER_MICRO_BATCH_SIZES = (1, 2)  # what the planner may choose for planned cases (all profiled)


@dataclass(frozen=True, kw_only=True)
class FidelityCase:
    """One plan to predict and run.

    Attributes:
        name: label in the report.
        model: the model (``tiny`` or a small one).
        pp, dp: pipeline ranks per replica, replicas (planned cases: ignored, the planner's).
        schedule: schedule family; virtual_stages for interleaved; warmup: hetero-1F1B's
            in-flight depth per stage (empty: 1F1B's).
        split: blocks (or layers) per stage, as ``--split`` takes it; None: balanced by speed.
        zero: ZeRO level per stage, as ``--zero`` takes it.
        micro_batches: per replica, as ``--micro-batches`` takes it (``"6,2"`` for uneven).
        micro_batch_size, seq_len: the shape of a micro-batch.
        slowdowns: emulated slowdown of each device (device ``k*dp + r`` runs replica r's rank k).
        buckets: ZeRO layer buckets per stage; gather_windows: ZeRO-3 gather rounds (0 streams).
        recompute: blocks recompute their forward before the backward (full); recompute_mode:
            the text of ``--recompute-mode`` (``selective``, ``full:1``, one per stage), which wins.
        clip_grad: clip gradients by their global norm (the runtime clips at norm 1.0).
        dtype: ``fp32``, or ``bf16`` (the runtime computes under CPU autocast; the simulator
            reads a bf16 profile and the bf16 memory model).
        from_planner: take the planner's plan of this rank (1 = best) for ``global_batch``
            sequences on the emulated cluster instead of the fields above (0: not planned).
        global_batch: sequences per step the planner plans for.
        tp: tensor-parallel degree per pipeline rank, as ``--tp`` takes it (``"2"``, ``"2,1"``;
            None: no TP). Each TP group's devices form one emulated node.
        groups: replica groups of their own shape (:mod:`medley.plan.segments`), each a dict of
            the fields above that a group chooses (``pp``, ``dp``, ``schedule``, ``split``,
            ``zero``, ``micro_batches``; no TP), on consecutive devices in group order; the
            case's own pp, dp, split, zero and micro_batches are then unused.
    """

    name: str
    model: ModelSpec
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    split: str | None = None
    zero: str | None = None
    micro_batches: str = "4"
    micro_batch_size: int = 2
    seq_len: int = 128
    slowdowns: tuple[float, ...] = ()
    virtual_stages: int = 2
    warmup: tuple[int, ...] = ()
    buckets: int = 1
    gather_windows: int = 1
    recompute: bool = False
    recompute_mode: str | None = None
    clip_grad: bool = False
    dtype: str = "fp32"
    from_planner: int = 0
    global_batch: int = 8
    tp: str | None = None
    groups: tuple[dict[str, Any], ...] = ()

    @property
    def degrees(self) -> tuple[int, ...]:
        """The TP degree of each pipeline rank (1 each without ``tp``)."""
        return parse_tp(self.tp, pp=self.pp) or (1,) * self.pp

    @property
    def world(self) -> int:
        if self.groups:
            return sum(int(g["pp"]) * int(g.get("dp", 1)) for g in self.groups)
        return len(self.slowdowns) if self.from_planner else devices_needed(pp=self.pp, dp=self.dp,
                                                                             tp=self.degrees)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        """Devices per emulated node in id order: one TP group each (the inline layout's
        :func:`~medley.plan.inline.default_assignment` puts rank k's dp groups side by side)."""
        if self.from_planner or self.groups:
            return ()
        return tuple(t for t in self.degrees for _ in range(self.dp))

    @property
    def profile_sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes the case's profile must cover."""
        return PLANNER_MICRO_BATCH_SIZES if self.from_planner else (self.micro_batch_size,)


def describe(layout: PlanLayout | Sequence[PlanLayout], slowdowns: Sequence[float] = ()) -> str:
    """The plan in words, from its layout or replica groups (what ran, whoever chose it)."""
    if not isinstance(layout, PlanLayout):
        groups = tuple(layout)
        if len(groups) > 1:
            return " + ".join(f"[{describe(g)}]" for g in groups) + (
                "" if all(f == 1.0 for f in slowdowns) else ", slow " + ",".join(f"{f:g}" for f in slowdowns))
        layout = groups[0]
    counts = sorted(set(layout.micro_batches))
    mb = ",".join(map(str, layout.micro_batches)) if len(counts) > 1 else str(counts[0])
    parts = [
        f"pp{layout.pp} dp{layout.dp}" + (f" tp{','.join(map(str, layout.tp))}" if layout.tp else ""),
        layout.schedule,
        f"mb {mb}x{layout.micro_batch_size}",
        f"seq {layout.seq_len}",
        "layers " + ",".join(map(str, layout.stage_layers)),
        "ZeRO " + ",".join(str(z.level) for z in layout.zero),
    ]
    if warmup := layout.knobs.get("warmup"):
        parts.append("warmup " + ",".join(map(str, warmup)))
    if any(z.buckets > 1 for z in layout.zero):
        parts.append("buckets " + ",".join(str(z.buckets) for z in layout.zero))
    if any(z.streams for z in layout.zero):
        parts.append("streamed")
    if any(layout.recompute):
        modes = [str(r) for r in layout.recompute]
        parts.append("recompute" if set(modes) == {"full"} else "recompute " + ",".join(modes))
    if layout.clip_grad:
        parts.append("clip")
    parts.append(layout.dtype)
    if any(f != 1.0 for f in slowdowns):
        parts.append("slow " + ",".join(f"{f:g}" for f in slowdowns))
    return ", ".join(parts)


def tags(layout: PlanLayout | Sequence[PlanLayout], case: FidelityCase) -> list[str]:
    """What a plan exercises, as labels the report groups errors by."""
    if not isinstance(layout, PlanLayout):
        groups = tuple(layout)
        if len(groups) > 1:
            inner = dict.fromkeys(t for g in groups for t in tags(g, case) if not t.endswith(" ranks"))
            ranks = sum(g.world_size for g in groups)
            return [f"{ranks} ranks", "replica groups", "data parallel", *inner]
        layout = groups[0]
    out = [f"{layout.world_size} ranks", layout.schedule, layout.dtype]
    out += ["pipeline"] if layout.pp > 1 else []
    out += ["tensor parallel"] if layout.tp else []
    out += ["data parallel"] if layout.dp > 1 else []
    levels = {z.level for z in layout.zero} if layout.dp > 1 else set()
    out += [f"ZeRO-{level}" for level in sorted(levels)]
    out += ["streamed ZeRO-3"] if layout.dp > 1 and any(z.streams for z in layout.zero) else []
    out += ["buckets > 1"] if any(z.buckets > 1 for z in layout.zero) else []
    out += ["recompute"] if any(layout.recompute) else []
    out += ["clip"] if layout.clip_grad else []
    out += ["uneven replicas"] if len(set(layout.micro_batches)) > 1 else []
    out += ["emulated slow ranks"] if any(f != 1.0 for f in case.slowdowns) else []
    out += ["planner's plan"] if case.from_planner else []
    return out


def emulate(
    case: FidelityCase,
    profile: Profile,
    *,
    profile_name: str,
    directory: Path,
    cores: int,
    background_cores: float = 0.0,
    used: Sequence[int] = (),
) -> tuple[EmulatedCluster, float]:
    """The case's emulated cluster and the compute stretch of its ranks sharing ``cores``
    with ``background_cores`` of other work (:func:`~medley.fidelity.emulate.core_share`). Only
    the devices in ``used`` (default: all) run ranks (a planner's plan may leave some out)."""
    slowdowns = case.slowdowns or (1.0,) * case.world
    if len(slowdowns) != case.world:
        raise ValueError(f"case {case.name}: {len(slowdowns)} slowdowns for {case.world} devices")
    ranks = [slowdowns[d] for d in used] if used else slowdowns
    share = core_share(ranks, cores=cores, background_cores=background_cores)
    emulated = emulated_cluster(
        profile,
        case.model,
        slowdowns,
        directory=directory,
        profile_name=profile_name,
        compute_share=share,
        name=f"emu-{case.name}",
        node_sizes=case.node_sizes,
    )
    return emulated, share


class NotRanked(ValueError):
    """A planner case asks for the k-th plan of a search that ranked fewer (its pruning kept
    fewer candidates within reach of the best): the case is skipped and the report says so."""


def case_groups(case: FidelityCase, emulated: EmulatedCluster) -> tuple[PlanLayout, ...]:
    """The case's plan as replica groups: written out (one group, or ``case.groups``), or the
    planner's (``medley plan``'s search) on ``emulated``."""
    if case.from_planner:
        from medley.search.planner import Constraints, search

        result = search(
            emulated.cluster,
            case.model,
            global_batch=case.global_batch,
            seq_len=case.seq_len,
            cost=emulated.cost,
            top=case.from_planner,
            constraints=Constraints(micro_batch_sizes=PLANNER_MICRO_BATCH_SIZES),
        )
        if len(result.plans) < case.from_planner:
            raise NotRanked(f"the planner ranked only {len(result.plans)} plan(s), not {case.from_planner}")
        groups = result.plans[case.from_planner - 1].plan.groups
        return joined([dataclasses.replace(layout, dtype=case.dtype) for layout in groups])
    if case.groups:
        layouts, first = [], 0
        for spec in case.groups:
            layout = _inline(dataclasses.replace(case, groups=(), tp=None, **spec), emulated)
            order = sorted(layout.devices)
            moved = {d: first + order.index(d) for d in order}
            layouts.append(dataclasses.replace(
                layout, assignment=tuple(tuple(moved[d] for d in row) for row in layout.assignment)))
            first += len(order)
        return joined(layouts)
    return (_inline(case, emulated),)


def _inline(case: FidelityCase, emulated: EmulatedCluster) -> PlanLayout:
    layout = inline_layout(
        cluster=emulated.cluster,
        model=case.model,
        cost=emulated.cost,
        pp=case.pp,
        dp=case.dp,
        schedule=case.schedule,
        micro_batches=case.micro_batches,
        micro_batch_size=case.micro_batch_size,
        seq_len=case.seq_len,
        virtual_stages=case.virtual_stages,
        split=case.split,
        zero=case.zero,
        buckets=case.buckets,
        gather_windows=case.gather_windows,
        recompute=case.recompute,
        recompute_mode=case.recompute_mode,
        dtype=case.dtype,
        clip_grad=case.clip_grad,
        tp=case.tp,
    )
    if case.warmup:
        layout = dataclasses.replace(layout, knobs={**layout.knobs, "warmup": tuple(case.warmup)})
    return layout


def build_plan(
    case: FidelityCase,
    profile: Profile,
    *,
    profile_name: str,
    directory: Path,
    cores: int,
    background_cores: float = 0.0,
) -> tuple[Plan, float]:
    """The case's plan on its emulated cluster with the simulator's prediction, and the ranks'
    compute stretch (see :func:`emulate`)."""
    emulated, share = emulate(
        case,
        profile,
        profile_name=profile_name,
        directory=directory,
        cores=cores,
        background_cores=background_cores,
    )
    groups = case_groups(case, emulated)
    prediction, _, _ = predict_groups(groups, emulated.cluster, cost=emulated.cost)
    return Plan(groups=groups, cluster=emulated.cluster, prediction=prediction), share


def _breakdown(problem: SimProblem, result: SimResult, emulated: EmulatedCluster) -> dict[str, float]:
    """The simulator's step on its busiest device."""
    busiest = max(result.devices, key=lambda r: r.busy_s)
    row = problem.schedules[busiest.replica].actions[busiest.rank]
    actions = sum(1 for a in row if a.is_compute)
    sends = sum(1 for a in row if a.kind in (Kind.SEND_F, Kind.SEND_B))
    device_type = emulated.cluster.devices[busiest.device].type.name
    per_action = emulated.cost.action_overhead_time(device_type=device_type) or 0.0
    return {
        "device": float(busiest.device),
        "step_s": result.step_time_s,
        "compute_s": busiest.busy_s,
        "overhead_s": actions * per_action,
        "bubble_s": busiest.bubble_s,
        "exposed_transfer_s": busiest.exposed_transfer_s,
        "exposed_zero_s": busiest.exposed_zero_s,
        "exposed_clip_s": busiest.exposed_clip_s,
        "clip_barrier_s": busiest.clip_barrier_s,
        "compute_actions": float(actions),
        "transfers": float(sends),
    }


def _median_actions(records: Sequence[StepRecord], device: int) -> dict[str, float]:
    """The median over ``records`` of a device's seconds in each action category."""
    from medley.runtime.executor import ACTION_CATEGORIES

    rows = [r.action_time_by_device.get(device, {}) for r in records]
    return {c: statistics.median(row.get(c, 0.0) for row in rows) for c in ACTION_CATEGORIES}


def _compute_steps(records: Sequence[StepRecord], device: int) -> list[float]:
    """A device's seconds in compute and optimizer actions, step by step."""
    return [busy_seconds(r.action_time_by_device.get(device, {})) for r in records]


def run_case(
    case: FidelityCase,
    profile: Profile,
    *,
    profile_name: str,
    directory: Path,
    steps: int = 20,
    warmup_steps: int = 5,
    cores: int | None = None,
) -> FidelityResult:
    """Predict, then train ``steps`` steps for real; the first ``warmup_steps`` are not timed.

    The prediction assumes the machine's cores serve only these ranks; the run measures what
    else used the CPU meanwhile, and ``loaded_*`` re-predicts the same plan with that background
    load. Other jobs can only add time, so the fastest step stands for the machine without them
    (``fastest_step_s``); the median is reported too. The first steps run slower while glibc's
    allocator adapts its mmap threshold to the step's large tensors (page faults), hence
    ``warmup_steps``. (Pinning each rank to one core was tried and made steps slower: the gloo
    threads then share the rank's core.)
    """
    from medley.launch.spawn import train_local
    from medley.runtime.train import TrainConfig

    cores = cores or len(os.sched_getaffinity(0)) or 1
    place = functools.partial(emulate, case, profile_name=profile_name, directory=directory, cores=cores)
    groups = case_groups(case, place(profile)[0])
    used = sorted(d for layout in groups for d in layout.devices)  # every device of every TP group
    emulated, share = place(profile, used=used)
    prediction, problem, result = predict_groups(groups, emulated.cluster, cost=emulated.cost)
    breakdown = _breakdown(problem, result, emulated)
    bare, _ = place(profile.model_copy(update={"overhead": None}), used=used)
    no_overhead, _, _ = predict_groups(groups, bare.cluster, cost=bare.cost)
    plan = Plan(groups=groups, cluster=emulated.cluster, prediction=prediction)
    config = TrainConfig.of(
        steps=steps,
        emulate=True,
        clip_norm=1.0 if groups[0].clip_grad else None,
        data="synthetic",
        measure_memory=True,
        progress=False,
        dtype=case.dtype,
        warmup_steps=0,
        trace_actions=True,
    )
    with cpu_meter() as use:
        records = train_local(plan, config)
    loaded, loaded_share = place(profile, used=used, background_cores=use[0].background_cores)
    loaded_prediction, _, _ = predict_groups(groups, loaded.cluster, cost=loaded.cost)
    timed = records[warmup_steps:] or records
    times = [r.step_time_s for r in timed]
    traced = [MeasuredStep.of(r) for r in timed]
    replayed = replay_steps(problem, traced)
    devices = sorted({d for r in timed for d in r.step_time_by_device})
    return FidelityResult(
        case=case.name,
        plan=describe(groups, case.slowdowns),
        dtype=case.dtype,
        predicted_step_s=prediction.step_time_s,
        predicted_no_overhead_s=no_overhead.step_time_s,
        loaded_predicted_step_s=loaded_prediction.step_time_s,
        measured_step_s=statistics.median(times),
        fastest_step_s=min(times),
        predicted_memory={d: gb * 1e9 for d, gb in prediction.peak_memory_gb.items()},
        measured_memory={int(d): float(b) for d, b in records[-1].peak_memory_bytes.items()},
        cost_source=prediction.cost_source,
        compute_share=share,
        loaded_compute_share=loaded_share,
        background_cores=use[0].background_cores,
        wall_s=use[0].wall_s,
        step_times_s=[r.step_time_s for r in records],
        breakdown=breakdown,
        measured_by_device={
            int(d): statistics.median(r.step_time_by_device.get(d, 0.0) for r in timed) for d in devices
        },
        measured_actions_by_device={int(d): _median_actions(timed, d) for d in devices},
        busiest_compute_s=_compute_steps(timed, int(breakdown["device"])),
        emulated_sleep_s=statistics.median(r.emulated_sleep_s for r in timed),
        tags=tags(groups, case),
        replay_step_s=replayed,
        replay_measured_s=[step.world_s for step in traced],
        replay_skew_s=statistics.median(max(step.skew_s.values()) for step in traced),
        world=len(used),
        cores=cores,
    )
