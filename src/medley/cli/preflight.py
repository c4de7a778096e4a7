"""What ``medley train`` checks and says before any rank builds a model: that this machine has the
plan's devices (:func:`check_devices`), what the plan asks of its memory, and the step time of the
precision the run computes in.

Both simulate the plan, so they live in the command line, not in :mod:`medley.runtime` (which reads
plans through :mod:`medley.plan.layout` and never loads the simulator): under torchrun each rank's
``medley train`` runs them before it joins the process group.

The simulator's per-device peak (the same memory model the planner used, in the precision the
runtime will actually train in) is compared with what the ranks of this machine can get: on CPU
every local rank shares the machine's available memory; on CUDA each rank has its own GPU. A plan
that cannot fit is refused with one line instead of allocating until the kernel kills a rank.
"""

from __future__ import annotations

import dataclasses
import os

from medley.errors import MedleyInputError
from medley.lowering.predict import predict_groups, simulate_groups
from medley.plan.plan import Plan
from medley.runtime.device_check import (
    CPU_CHOICE,
    NodeDevices,
    device_problems,
    gpu_devices,
    planned_types,
    probe,
    where,
)
from medley.runtime.placement import my_identity, planned_device
from medley.runtime.setup import check_plan
from medley.spec.catalog import check_precision

GIB = 2**30
# Anonymous memory of a rank before its model exists: torch, gloo and medley imported (measured
# 233 MB RssAnon on torch 2.13 CPU); the simulator's peak does not count it.
RANK_BASE_BYTES = 256 * 2**20


def predicted_peaks(plan: Plan, *, dtype: str) -> dict[int, float]:
    """Peak bytes per device id of the plan when trained in ``dtype`` (fp32, bf16 or fp16)."""
    groups = [dataclasses.replace(group, dtype=dtype) for group in plan.groups]
    _, result = simulate_groups(groups, plan.cluster, comm=False,
                                where="the plan (--dp, --micro-batches, --zero, --buckets, --gather-windows)")
    return {report.device: report.peak_memory_bytes for report in result.devices}


def available_cpu_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else total RAM."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_cpu_memory(plan: Plan, *, dtype: str, local_ranks: int, available: int | None = None) -> None:
    """``local_ranks`` ranks of ``plan`` on this machine's CPU: the largest ``local_ranks`` peaks
    (all of them when the whole plan runs here) plus each rank's base must fit in ``available``."""
    peaks = sorted(predicted_peaks(plan, dtype=dtype).values(), reverse=True)[:local_ranks]
    needed = sum(peaks) + RANK_BASE_BYTES * len(peaks)
    free = available_cpu_bytes() if available is None else available
    if needed > free:
        raise MedleyInputError(
            f"train: {len(peaks)} rank(s) of this plan need about {needed / GIB:.1f} GiB of memory "
            f"({dtype}, predicted peak {peaks[0] / GIB:.1f} GiB for the largest rank) but this machine has "
            f"{free / GIB:.1f} GiB available; use a smaller model, more pipeline stages, ZeRO-3 or "
            "recomputation, or run it on devices with more memory")


def check_cuda_memory(plan: Plan, *, dtype: str, rank: int, world: int) -> None:
    """This rank's predicted peak against its GPU's total memory; the rank's plan device is the
    one :mod:`medley.runtime.placement` gives it (no device: the placement check says why)."""
    import torch

    identity = my_identity(plan.cluster, rank=rank, world=world, on_cuda=False)
    device = planned_device(plan, identity)
    if device is None:
        return
    peak = predicted_peaks(plan, dtype=dtype)[device]
    local_rank = identity.local_rank
    total = torch.cuda.get_device_properties(local_rank).total_memory
    if peak > total:
        raise MedleyInputError(
            f"train: rank {rank} runs plan device {device} whose predicted peak is {peak / GIB:.1f} GiB "
            f"({dtype}) but cuda:{local_rank} has {total / GIB:.1f} GiB; re-plan for this GPU "
            "(medley plan --cluster with its real memory_gb)")


def preflight(plan: Plan, *, dtype: str, local_ranks: int, on_cuda: bool) -> None:
    """Everything that can be refused before a rank starts: what the runtime cannot run
    (:func:`medley.runtime.setup.check_plan`) and memory. Under torchrun on CUDA each rank checks
    its own GPU; ``local_ranks`` is the number of this plan's ranks on this machine."""
    check_plan(plan, plan.world_size)
    if on_cuda:  # a CPU run emulates the plan's devices and computes bf16 on any of them
        check_precision(dtype, plan.cluster.device_types(plan.devices).values(), where="--dtype bf16",
                        fix="give --dtype fp16 or fp32 (or leave --dtype out: the plan's dtype)")
    if not on_cuda:
        check_cpu_memory(plan, dtype=dtype, local_ranks=local_ranks)
    elif "RANK" in os.environ:
        check_cuda_memory(plan, dtype=dtype, rank=int(os.environ["RANK"]),
                          world=int(os.environ.get("WORLD_SIZE", str(plan.world_size))))


def check_devices(plan: Plan, *, device: str, emulate: bool, local_ranks: int | None,
                  found: NodeDevices | None = None, command: str = "train") -> str | None:
    """Refuse, before any rank starts, a plan whose GPU types this machine does not have
    (:func:`medley.runtime.device_check.device_problems`: with ``local_ranks`` this machine plays
    every node; under torchrun it is the rank's own node); ``device`` ``cpu`` or ``emulate`` run a
    GPU plan on the CPU on purpose, and the line returned says so (None for a plan of CPU types or
    one that runs on its GPUs). ``found``: what this machine has (default: :func:`probe`);
    ``command`` starts the error line."""
    node: str | None = None
    if local_ranks is None and "RANK" in os.environ:
        identity = my_identity(plan.cluster, rank=int(os.environ["RANK"]),
                               world=int(os.environ.get("WORLD_SIZE", str(plan.world_size))), on_cuda=False)
        if identity.error is not None:
            return None  # the placement check names why every rank alike
        node = identity.node
    gpus = gpu_devices(plan, node)
    if not gpus:
        return None
    if device == "cpu" or emulate:
        why = ("--device cpu" if device == "cpu" else
               "--emulate: compute stretched to the plan's device speeds")
        return (f"device: {where(node)} runs the plan's {planned_types(plan, gpus)} on the CPU (gloo), "
                f"on purpose ({why})")
    problems = device_problems(plan, probe() if found is None else found, node=node)
    if problems:
        raise MedleyInputError(f"{command}: {problems[0]}; {CPU_CHOICE}")
    return None


def precision_note(plan: Plan, dtype: str, *, chosen: bool) -> str | None:
    """One line when the run computes in another precision than the plan's, with the step time the
    simulator predicts for each (catalog costs); None when they agree. ``medley train`` prints it
    once (rank 0 under torchrun) before the ranks start."""
    planned = plan.shared.dtype
    if dtype == planned:
        return None
    why = f"--dtype {dtype}" if chosen else "the default on CPU; --dtype sets it"
    line = f"precision: the plan trains in {planned} but this run computes in {dtype} ({why})"
    try:
        times = {name: predict_groups([dataclasses.replace(group, dtype=name) for group in plan.groups],
                                      plan.cluster)[0].step_time_s for name in (dtype, planned)}
    except MedleyInputError as err:  # a note: the run goes on without the figures
        return f"{line}; no step time predicted ({err})"
    return (f"{line}; predicted step time {_seconds(times[dtype])} in {dtype} against "
            f"{_seconds(times[planned])} in {planned}")


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"
