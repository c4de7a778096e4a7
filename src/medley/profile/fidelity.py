"""The fidelity loop: profile, simulate, run for real, compare step time and peak memory.

For each :class:`FidelityCase` (a plan on an emulated CPU cluster, see :mod:`medley.profile.emulate`)
the simulator predicts one step from the measured profile, then medley's runtime trains the same
plan on this machine (gloo, one rank per device, emulation on) and reports step time (median over
the steps after warm-up, max over ranks) and peak live tensor bytes per rank (torch's MemTracker
probe step). Errors are (predicted - measured) / measured.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from medley.cost.profiles import Profile
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.plan.predict import predict
from medley.profile.emulate import emulated_cluster
from medley.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class FidelityCase:
    """One plan to predict and run.

    Attributes:
        name: label in the report.
        model: the model (``tiny`` or a small one).
        pp, dp: pipeline ranks per replica, replicas.
        schedule: schedule family; virtual_stages for interleaved.
        split: blocks (or layers) per stage, as ``--split`` takes it; None: balanced by speed.
        zero: ZeRO level per stage, as ``--zero`` takes it.
        micro_batches: per replica, as ``--micro-batches`` takes it (``"6,2"`` for uneven).
        micro_batch_size, seq_len: the shape of a micro-batch.
        slowdowns: emulated slowdown of each device (device ``k*dp + r`` runs replica r's rank k).
        gather_windows: ZeRO-3 gather rounds (0 streams buckets).
    """

    name: str
    model: ModelSpec
    pp: int
    dp: int
    schedule: str = "1f1b"
    split: str | None = None
    zero: str | None = None
    micro_batches: str = "4"
    micro_batch_size: int = 2
    seq_len: int = 128
    slowdowns: tuple[float, ...] = ()
    virtual_stages: int = 2
    buckets: int = 1
    gather_windows: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp


@dataclass(kw_only=True)
class FidelityResult:
    """Predicted and measured figures of one case."""

    case: str
    plan: str
    predicted_step_s: float
    measured_step_s: float
    measured_step_spread_s: float
    predicted_memory: dict[int, float]
    measured_memory: dict[int, float]
    cost_source: str
    compute_share: float
    wall_s: float
    step_times_s: list[float] = field(default_factory=list)

    @property
    def step_error(self) -> float:
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def memory_errors(self) -> dict[int, float]:
        return {d: (self.predicted_memory[d] - m) / m for d, m in self.measured_memory.items()
                if m > 0 and d in self.predicted_memory}

    @property
    def worst_memory_error(self) -> float:
        errors = self.memory_errors
        return max(errors.values(), key=abs) if errors else float("nan")


def describe(case: FidelityCase) -> str:
    parts = [f"pp{case.pp} dp{case.dp}", case.schedule, f"mb {case.micro_batches}x{case.micro_batch_size}",
             f"seq {case.seq_len}"]
    if case.split:
        parts.append(f"split {case.split}")
    if case.zero:
        parts.append(f"ZeRO {case.zero}")
    if any(f != 1.0 for f in case.slowdowns):
        parts.append("slow " + ",".join(f"{f:g}" for f in case.slowdowns))
    return ", ".join(parts)


def build_plan(case: FidelityCase, profile: Profile, *, profile_name: str, directory: Path,
               cores: int) -> tuple[Plan, float]:
    """The case's plan on its emulated cluster, with the simulator's prediction."""
    slowdowns = case.slowdowns or (1.0,) * case.world
    if len(slowdowns) != case.world:
        raise ValueError(f"case {case.name}: {len(slowdowns)} slowdowns for {case.world} devices")
    share = max(1.0, case.world / cores)
    emulated = emulated_cluster(profile, case.model, slowdowns, directory=directory,
                                profile_name=profile_name, compute_share=share, name=f"emu-{case.name}")
    layout = inline_layout(
        cluster=emulated.cluster, model=case.model, cost=emulated.cost, pp=case.pp, dp=case.dp,
        schedule=case.schedule, micro_batches=case.micro_batches, micro_batch_size=case.micro_batch_size,
        seq_len=case.seq_len, virtual_stages=case.virtual_stages, split=case.split, zero=case.zero,
        buckets=case.buckets, gather_windows=case.gather_windows, dtype=profile.dtype,
    )
    prediction, _, _ = predict(layout, emulated.cluster, cost=emulated.cost)
    return Plan(layout=layout, cluster=emulated.cluster, prediction=prediction), share


def run_case(case: FidelityCase, profile: Profile, *, profile_name: str, directory: Path, steps: int = 6,
             warmup_steps: int = 2, cores: int | None = None) -> FidelityResult:
    """Predict, then train ``steps`` steps for real; the first ``warmup_steps`` are not timed."""
    from medley.runtime.launch import train_local
    from medley.runtime.train import TrainConfig

    cores = cores or os.cpu_count() or 1
    plan, share = build_plan(case, profile, profile_name=profile_name, directory=directory, cores=cores)
    assert plan.prediction is not None
    config = TrainConfig(steps=steps, emulate=True, clip_norm=None, data="synthetic", measure_memory=True,
                         progress=False, dtype=profile.dtype, warmup_steps=0)
    started = time.perf_counter()
    records = train_local(plan, config)
    wall = time.perf_counter() - started
    times = [r.step_time_s for r in records[warmup_steps:]] or [r.step_time_s for r in records]
    memory = {int(d): float(b) for d, b in records[-1].peak_memory_bytes.items()}
    return FidelityResult(
        case=case.name, plan=describe(case), predicted_step_s=plan.prediction.step_time_s,
        measured_step_s=statistics.median(times), measured_step_spread_s=max(times) - min(times),
        predicted_memory={d: gb * 1e9 for d, gb in plan.prediction.peak_memory_gb.items()},
        measured_memory=memory, cost_source=plan.prediction.cost_source, compute_share=share, wall_s=wall,
        step_times_s=[r.step_time_s for r in records],
    )


def summarize(results: Sequence[FidelityResult]) -> dict[str, float]:
    steps = [abs(r.step_error) for r in results]
    memory = [abs(e) for r in results for e in r.memory_errors.values()]
    return {
        "cases": len(results),
        "median_abs_step_error": statistics.median(steps) if steps else float("nan"),
        "worst_abs_step_error": max(steps) if steps else float("nan"),
        "median_abs_memory_error": statistics.median(memory) if memory else float("nan"),
        "worst_abs_memory_error": max(memory) if memory else float("nan"),
    }
