"""The fidelity loop: profile, simulate, run for real, compare step time and peak memory.

For each :class:`FidelityCase` (a plan on an emulated CPU cluster, see :mod:`medley.fidelity.emulate`)
the simulator predicts one step from the measured profile, then medley's runtime trains the same
plan on this machine (gloo, one rank per device, emulation on) and reports step time (median over
the steps after warm-up, max over ranks) and peak live tensor bytes per rank (the runtime's
live-tensor probe step, :mod:`medley.runtime.memory`). Errors are (predicted - measured) / measured.
A case is either written out (pp, dp, schedule, split, ZeRO, ...) or taken from ``medley plan``'s
ranking on its emulated cluster (``from_planner``); :mod:`medley.fidelity.plans` makes its plan.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from medley.cost.profile_format import Profile
from medley.fidelity.emulate import EmulatedCluster
from medley.fidelity.plans import FidelityCase, case_groups, describe, emulate, tags
from medley.fidelity.replay import MeasuredStep, replay_steps
from medley.fidelity.results import (
    FidelityResult,
    busy_seconds,
)
from medley.lowering.predict import predict_groups
from medley.plan.plan import Plan
from medley.profile.cpu_load import cpu_meter
from medley.schedule.ir import Kind
from medley.sim.problem import SimProblem
from medley.sim.result import SimResult

if TYPE_CHECKING:
    from medley.runtime.records import StepRecord


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
