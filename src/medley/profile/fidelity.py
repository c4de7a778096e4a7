"""The fidelity loop: profile, simulate, run for real, compare step time and peak memory.

For each :class:`FidelityCase` (a plan on an emulated CPU cluster, see :mod:`medley.profile.emulate`)
the simulator predicts one step from the measured profile, then medley's runtime trains the same
plan on this machine (gloo, one rank per device, emulation on) and reports step time (median over
the steps after warm-up, max over ranks) and peak live tensor bytes per rank (the runtime's
live-tensor probe step, :mod:`medley.runtime.memory`). Errors are (predicted - measured) / measured.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from medley.cost.profiles import Profile
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.plan.predict import predict
from medley.profile.emulate import core_share, emulated_cluster
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

    @property
    def step_error(self) -> float:
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    @property
    def fastest_step_error(self) -> float:
        """Quiet-machine prediction against the fastest measured step."""
        return (self.predicted_step_s - self.fastest_step_s) / self.fastest_step_s

    @property
    def loaded_step_error(self) -> float:
        return (self.loaded_predicted_step_s - self.measured_step_s) / self.measured_step_s

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


@dataclass(frozen=True, kw_only=True)
class CpuUse:
    """CPU time over a run: the whole machine's, this process tree's, and the rest (other users).

    Attributes:
        wall_s: duration.
        machine_cores: busy cores of the machine, on average.
        own_cores: cores used by this process and its finished children, on average.
        background_cores: the rest: other processes sharing the machine.
    """

    wall_s: float
    machine_cores: float
    own_cores: float

    @property
    def background_cores(self) -> float:
        return max(0.0, self.machine_cores - self.own_cores)


def _busy_seconds() -> float:
    with open("/proc/stat") as handle:
        fields = handle.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def cpu_meter() -> Iterator[list[CpuUse]]:
    """Measure CPU use around a block (Linux ``/proc/stat``); the result is appended to the list."""
    out: list[CpuUse] = []
    wall, busy, own = time.perf_counter(), _busy_seconds(), _own_seconds()
    yield out
    elapsed = time.perf_counter() - wall
    out.append(CpuUse(wall_s=elapsed, machine_cores=(_busy_seconds() - busy) / elapsed,
                      own_cores=(_own_seconds() - own) / elapsed))


def build_plan(case: FidelityCase, profile: Profile, *, profile_name: str, directory: Path, cores: int,
               background_cores: float = 0.0) -> tuple[Plan, float]:
    """The case's plan on its emulated cluster, with the simulator's prediction.

    Ranks are processes sharing ``cores`` with ``background_cores`` of other work; their compute
    stretches by :func:`~medley.profile.emulate.core_share`. Returns the plan and that stretch.
    """
    slowdowns = case.slowdowns or (1.0,) * case.world
    if len(slowdowns) != case.world:
        raise ValueError(f"case {case.name}: {len(slowdowns)} slowdowns for {case.world} devices")
    share = core_share(slowdowns, cores=cores, background_cores=background_cores)
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


def run_case(case: FidelityCase, profile: Profile, *, profile_name: str, directory: Path, steps: int = 20,
             warmup_steps: int = 5, cores: int | None = None) -> FidelityResult:
    """Predict, then train ``steps`` steps for real; the first ``warmup_steps`` are not timed.

    The prediction assumes the machine's cores serve only these ranks; the run measures what
    else used the CPU meanwhile, and ``loaded_*`` re-predicts with that background load. Other
    jobs can only add time, so the fastest step stands for the machine without them
    (``fastest_step_s``); the median is reported too. The first steps run slower while glibc's
    allocator adapts its mmap threshold to the step's large tensors (page faults), hence
    ``warmup_steps``. (Pinning each rank to one core was tried and made steps slower: the gloo
    threads then share the rank's core.)
    """
    from medley.runtime.launch import train_local
    from medley.runtime.train import TrainConfig

    cores = cores or os.cpu_count() or 1
    plan, share = build_plan(case, profile, profile_name=profile_name, directory=directory, cores=cores)
    assert plan.prediction is not None
    config = TrainConfig(steps=steps, emulate=True, clip_norm=None, data="synthetic", measure_memory=True,
                         progress=False, dtype=profile.dtype, warmup_steps=0)
    with cpu_meter() as use:
        records = train_local(plan, config)
    loaded, loaded_share = build_plan(case, profile, profile_name=profile_name, directory=directory,
                                      cores=cores, background_cores=use[0].background_cores)
    assert loaded.prediction is not None
    times = [r.step_time_s for r in records[warmup_steps:]] or [r.step_time_s for r in records]
    memory = {int(d): float(b) for d, b in records[-1].peak_memory_bytes.items()}
    return FidelityResult(
        case=case.name, plan=describe(case), predicted_step_s=plan.prediction.step_time_s,
        loaded_predicted_step_s=loaded.prediction.step_time_s,
        measured_step_s=statistics.median(times), fastest_step_s=min(times),
        predicted_memory={d: gb * 1e9 for d, gb in plan.prediction.peak_memory_gb.items()},
        measured_memory=memory, cost_source=plan.prediction.cost_source, compute_share=share,
        loaded_compute_share=loaded_share, background_cores=use[0].background_cores, wall_s=use[0].wall_s,
        step_times_s=[r.step_time_s for r in records],
    )


def summarize(results: Sequence[FidelityResult]) -> dict[str, float]:
    steps = [abs(r.step_error) for r in results]
    loaded = [abs(r.loaded_step_error) for r in results]
    fastest = [abs(r.fastest_step_error) for r in results]
    memory = [abs(e) for r in results for e in r.memory_errors.values()]
    return {
        "cases": len(results),
        "median_abs_step_error": statistics.median(steps) if steps else float("nan"),
        "worst_abs_step_error": max(steps) if steps else float("nan"),
        "median_abs_fastest_step_error": statistics.median(fastest) if fastest else float("nan"),
        "worst_abs_fastest_step_error": max(fastest) if fastest else float("nan"),
        "median_abs_loaded_step_error": statistics.median(loaded) if loaded else float("nan"),
        "worst_abs_loaded_step_error": max(loaded) if loaded else float("nan"),
        "median_abs_memory_error": statistics.median(memory) if memory else float("nan"),
        "worst_abs_memory_error": max(memory) if memory else float("nan"),
    }
