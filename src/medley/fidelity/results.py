"""What one fidelity case measured against what the simulator predicted, and the figures over
many cases (:func:`summarize`) and the bounds a test holds them to (:func:`timing_failure`,
:func:`memory_failure`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def busy_seconds(actions: Mapping[str, float]) -> float:
    """Of a rank's seconds by kind of action (``medley.runtime.executor.ACTION_CATEGORIES``), those
    in compute and optimizer actions: what the simulator's compute holds."""
    return actions.get("compute", 0.0) + actions.get("optim", 0.0)


@dataclass(kw_only=True)
class FidelityResult:
    """Predicted and measured figures of one case.

    Attributes:
        case, plan: the case's name and its plan in words (:func:`describe`).
        dtype: the precision it ran in.
        predicted_step_s: the simulator's step on a quiet machine; loaded_predicted_step_s: the
            same with the background load measured during the run.
        predicted_no_overhead_s: the quiet prediction without the profile's per-action overhead.
        measured_step_s, fastest_step_s: median and fastest timed step.
        predicted_memory, measured_memory: peak bytes per device id.
        breakdown: the simulator's step on its busiest device: ``device``, ``compute_s`` (of it
            ``overhead_s``: per-action overhead), ``bubble_s``, ``exposed_transfer_s``,
            ``exposed_zero_s``, ``exposed_clip_s``, ``clip_barrier_s`` (the simulator's parts),
            ``compute_actions``, ``transfers`` (sent by that device).
        measured_by_device: each rank's median timed step, by device id.
        measured_actions_by_device: of it, each rank's median seconds per kind of action
            (``medley.runtime.executor.ACTION_CATEGORIES``: compute, transfer, zero, optim, clip),
            by device id: what tells a compute error from one in the waits.
        busiest_compute_s: the busiest device's seconds in compute and optimizer actions in each
            timed step: the same work every step, so their spread is the machine's noise.
        emulated_sleep_s: median per step of the longest emulation sleep of any rank.
        cost_source, compute_share, loaded_compute_share, background_cores, wall_s: how it was
            predicted and run (see :func:`run_case`); step_times_s: every step measured.
        tags: what the plan exercises (:func:`tags`), to group errors by.
        replay_step_s: each timed step simulated with that step's measured compute durations
            (:mod:`medley.fidelity.replay`); replay_measured_s: the same steps as measured,
            from the first rank's start to the last rank's end; replay_skew_s: the median over
            them of how much later the last rank began than the first.
        world: ranks the case ran (devices of every TP group); cores: the cores they ran on.
    """

    case: str
    plan: str
    predicted_step_s: float
    loaded_predicted_step_s: float
    measured_step_s: float
    fastest_step_s: float
    predicted_memory: dict[int, float]
    measured_memory: dict[int, float]
    cost_source: str
    compute_share: float
    loaded_compute_share: float
    background_cores: float
    wall_s: float
    step_times_s: list[float] = field(default_factory=list)
    dtype: str = "fp32"
    predicted_no_overhead_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    measured_by_device: dict[int, float] = field(default_factory=dict)
    measured_actions_by_device: dict[int, dict[str, float]] = field(default_factory=dict)
    busiest_compute_s: list[float] = field(default_factory=list)
    emulated_sleep_s: float = 0.0
    tags: list[str] = field(default_factory=list)
    replay_step_s: list[float] = field(default_factory=list)
    replay_measured_s: list[float] = field(default_factory=list)
    replay_skew_s: float = 0.0
    world: int = 0
    cores: int = 0

    @property
    def replay_errors(self) -> list[float]:
        """Each timed step's replay (its own measured compute in the simulator) against that step."""
        return [(s - m) / m for s, m in zip(self.replay_step_s, self.replay_measured_s, strict=True) if m > 0]

    @property
    def replay_error(self) -> float:
        """The median over the timed steps of the replay's signed error (nan: not replayed)."""
        return _median(self.replay_errors)

    @property
    def replay_abs_error(self) -> float:
        """The median over the timed steps of the replay's |error|: the case's replay figure."""
        return _median([abs(e) for e in self.replay_errors])

    @property
    def within_cores(self) -> bool:
        """Whether every rank had a core of its own (no more ranks than cores): the cases the
        end-to-end figure is taken on; the others are predicted with the core-sharing stretch."""
        return 0 < self.world <= self.cores

    @property
    def step_error(self) -> float:
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def fastest_step_error(self) -> float:
        """Quiet-machine prediction against the fastest measured step."""
        return (self.predicted_step_s - self.fastest_step_s) / self.fastest_step_s

    @property
    def no_overhead_error(self) -> float:
        """The prediction without the per-action overhead, against the fastest step."""
        return (self.predicted_no_overhead_s - self.fastest_step_s) / self.fastest_step_s

    @property
    def loaded_step_error(self) -> float:
        return (self.loaded_predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def measured_busy_s(self) -> float:
        """The busiest device's measured median seconds in compute and optimizer actions (what the
        simulator's ``compute_s`` holds); 0 when not measured."""
        return busy_seconds(self.measured_actions_by_device.get(int(self.breakdown.get("device", -1)), {}))

    @property
    def compute_error(self) -> float:
        """The busiest device's predicted compute (the optimizer's included) against what it
        measured (nan when either is unknown): the part of the step-time error the layer and
        optimizer costs make."""
        measured = self.measured_busy_s
        if measured <= 0 or "compute_s" not in self.breakdown:
            return float("nan")
        return (self.breakdown["compute_s"] - measured) / measured

    @property
    def compute_spread(self) -> float:
        """How much longer the busiest device's compute took in its median timed step than in
        its fastest (nan if not measured): identical work, so this is the noise of the machine
        that no prediction of one step time can follow."""
        steps = [t for t in self.busiest_compute_s if t > 0]
        return statistics.median(steps) / min(steps) - 1.0 if steps else float("nan")

    @property
    def rest_error(self) -> float:
        """The same device's predicted step minus its compute (bubble, transfers, collectives,
        clipping) against its measured median step minus its measured compute (nan if unknown)."""
        device = int(self.breakdown.get("device", -1))
        measured = self.measured_by_device.get(device, 0.0) - self.measured_busy_s
        if self.measured_busy_s <= 0 or measured <= 0:
            return float("nan")
        return (self.predicted_step_s - self.breakdown["compute_s"] - measured) / measured

    @property
    def memory_errors(self) -> dict[int, float]:
        return {
            d: (self.predicted_memory[d] - m) / m
            for d, m in self.measured_memory.items()
            if m > 0 and d in self.predicted_memory
        }

    @property
    def worst_memory_error(self) -> float:
        errors = self.memory_errors
        return max(errors.values(), key=abs) if errors else float("nan")


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]  # nan: not measured in that case
    return statistics.median(values) if values else float("nan")


def _worst(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]  # nan: not measured in that case
    return max(values) if values else float("nan")


def _group_figures(rows: Sequence[FidelityResult]) -> dict[str, float]:
    """Replay and end-to-end figures of some cases (a feature's, the ones within the cores)."""
    replay = [r.replay_abs_error for r in rows]
    return {
        "cases": len(rows),
        "median_abs_replay_error": _median(replay),
        "worst_abs_replay_error": _worst(replay),
        "median_replay_error": _median([r.replay_error for r in rows]),
        "median_abs_step_error": _median([abs(r.step_error) for r in rows]),
        "worst_abs_step_error": _worst([abs(r.step_error) for r in rows]),
        "median_abs_fastest_step_error": _median([abs(r.fastest_step_error) for r in rows]),
    }


def replay_summary(results: Sequence[FidelityResult]) -> dict[str, Any]:
    """The replay figures over ``results``, the end-to-end figures on the cases within the cores
    and on those sharing them, and both per feature (tag)."""
    replay = [r.replay_abs_error for r in results]
    steps = [abs(e) for r in results for e in r.replay_errors]
    within = [r for r in results if r.within_cores]
    sharing = [r for r in results if not r.within_cores]
    tags = sorted({t for r in results for t in r.tags})
    return {
        "median_abs_replay_error": _median(replay),
        "worst_abs_replay_error": _worst(replay),
        "median_replay_error": _median([r.replay_error for r in results]),
        "worst_abs_replay_step_error": _worst(steps),
        "replayed_steps": len(steps),
        "cases_within_cores": len(within),
        "median_abs_step_error_within_cores": _median([abs(r.step_error) for r in within]),
        "worst_abs_step_error_within_cores": _worst([abs(r.step_error) for r in within]),
        "median_abs_fastest_step_error_within_cores": _median([abs(r.fastest_step_error) for r in within]),
        "cases_sharing_cores": len(sharing),
        "median_abs_step_error_sharing_cores": _median([abs(r.step_error) for r in sharing]),
        "worst_abs_step_error_sharing_cores": _worst([abs(r.step_error) for r in sharing]),
        "by_feature": {tag: _group_figures([r for r in results if tag in r.tags]) for tag in tags},
    }


def summarize(results: Sequence[FidelityResult]) -> dict[str, Any]:
    steps = [abs(r.step_error) for r in results]
    loaded = [abs(r.loaded_step_error) for r in results]
    fastest = [abs(r.fastest_step_error) for r in results]
    bare = [abs(r.no_overhead_error) for r in results if r.predicted_no_overhead_s > 0]
    memory = {
        dtype: [abs(e) for r in results if r.dtype == dtype for e in r.memory_errors.values()]
        for dtype in ("fp32", "bf16")
    }
    everything = memory["fp32"] + memory["bf16"]
    return {
        "cases": len(results),
        "median_abs_step_error": _median(steps),
        "worst_abs_step_error": _worst(steps),
        "median_abs_fastest_step_error": _median(fastest),
        "worst_abs_fastest_step_error": _worst(fastest),
        "median_fastest_step_error": _median([r.fastest_step_error for r in results]),
        "median_abs_no_overhead_error": _median(bare),
        "worst_abs_no_overhead_error": _worst(bare),
        "median_compute_error": _median([r.compute_error for r in results]),
        "median_rest_error": _median([r.rest_error for r in results]),
        "median_compute_spread": _median([r.compute_spread for r in results]),
        "worst_compute_spread": _worst([r.compute_spread for r in results]),
        "median_abs_loaded_step_error": _median(loaded),
        "worst_abs_loaded_step_error": _worst(loaded),
        "median_abs_memory_error": _median(everything),
        "worst_abs_memory_error": _worst(everything),
        "median_abs_memory_error_fp32": _median(memory["fp32"]),
        "worst_abs_memory_error_fp32": _worst(memory["fp32"]),
        "median_abs_memory_error_bf16": _median(memory["bf16"]),
        "worst_abs_memory_error_bf16": _worst(memory["bf16"]),
        **replay_summary(results),
    }


def timing_failure(results: Sequence[FidelityResult], *, bound: float) -> str | None:
    """Why the median |step-time error| against the fastest step exceeds ``bound``, or None."""
    median = _median([abs(r.fastest_step_error) for r in results])
    if median <= bound:
        return None
    cases = ", ".join(
        f"{r.case} {r.predicted_step_s * 1e3:.1f} ms predicted vs {r.fastest_step_s * 1e3:.1f} ms "
        f"fastest ({r.fastest_step_error:+.0%})"
        for r in results
    )
    return f"median |step-time error| {median:.0%} exceeds {bound:.0%}: {cases}"


def memory_failure(results: Sequence[FidelityResult], *, bound: float) -> str | None:
    """The first rank whose peak-memory error exceeds ``bound``, or None."""
    for r in results:
        for device, error in sorted(r.memory_errors.items()):
            if abs(error) > bound:
                return f"{r.case} device {device}: peak memory off by {error:+.1%} (bound {bound:.0%})"
    return None
