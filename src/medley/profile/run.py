"""One profiling run: layers (and optionally collectives) measured into a :class:`Profile`."""

from __future__ import annotations

import datetime
import os
import platform
import socket
from collections.abc import Callable, Sequence

import torch

from medley.cost.profile_format import PROFILE_FORMAT, PROFILE_VERSION, Profile, model_dict
from medley.errors import MedleyInputError
from medley.profile.comm_bench import comm_profile, measure_collectives
from medley.profile.layers import profile_layers, profile_optimizer
from medley.runtime.sharding import TORCH_DTYPES
from medley.spec.catalog import CPU_DEVICE_TYPE, device_type_for_cuda, get_device_type
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec


def profile_steps(comm_ranks: Sequence[int], *, overhead: bool = False) -> int:
    """How many progress steps :func:`run_profile` reports."""
    return 2 + bool(comm_ranks) + overhead


def _device_detail(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 - a short read
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_device_type(device: str, device_type: str | None) -> str:
    """The catalog name a profile of ``device`` is labelled with: ``device_type`` (``--device-type``)
    when given, else the CUDA GPU's catalog entry, else the generic CPU core."""
    if device_type is not None:
        try:
            return get_device_type(device_type).name
        except MedleyInputError as err:
            raise MedleyInputError(f"--device-type {printable(device_type)}: {err}") from None
    if device == "cuda":
        return device_type_for_cuda(torch.cuda.get_device_name(0)).name
    return CPU_DEVICE_TYPE


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run_profile(
    model: ModelSpec, *, device: str = "cpu", device_type: str | None = None,
    micro_batch_sizes: Sequence[int] = (1, 2, 4), seq_lens: Sequence[int] = (128,), dtype: str = "fp32",
    threads: int = 1, warmup: int = 2, runs: int = 5, comm_ranks: Sequence[int] = (2, 4),
    comm_sizes: Sequence[int] | None = None, progress: Callable[[str], None] | None = None,
    overhead: bool = False, compiled: bool = False,
) -> Profile:
    """Measure ``model``'s layers on ``device`` (and gloo collectives when ``comm_ranks`` is given).
    ``overhead``: also the runtime's per-action and per-transfer overhead
    (:mod:`medley.profile.overhead`, CPU only). ``progress(description)`` is called as each of
    :func:`profile_steps` steps starts. ``compiled``: blocks timed compiled, as ``medley train
    --compile`` runs them (the profile says so in ``compiled``)."""
    if overhead and device != "cpu":
        raise MedleyInputError("--overhead is measured on CPU ranks (gloo) only; pass --no-overhead")
    if device not in ("cpu", "cuda"):
        raise MedleyInputError(f"--device '{device}' must be cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise MedleyInputError("--device cuda: torch sees no CUDA device here; use --device cpu")
    if dtype not in TORCH_DTYPES:
        raise MedleyInputError(f"--dtype '{dtype}' must be one of {', '.join(TORCH_DTYPES)}")
    if not micro_batch_sizes or not seq_lens or min(*micro_batch_sizes, *seq_lens) < 1:
        raise MedleyInputError("--micro-batch-sizes and --seq-len need positive integers, like 1,2,4")
    if model.position == "learned" and max(seq_lens) > model.max_seq_len:
        raise MedleyInputError(f"--seq-len {max(seq_lens)} exceeds {model.name}'s max_seq_len "
                               f"{model.max_seq_len}; profile shorter sequences")
    name = profile_device_type(device, device_type)
    step = progress or (lambda _description: None)
    step(f"{model.name}: measuring layers")
    layers = profile_layers(model, micro_batch_sizes=micro_batch_sizes, seq_lens=seq_lens, dtype=dtype,
                            device=device, threads=threads, warmup=warmup, runs=runs, compiled=compiled)
    step(f"{model.name}: measuring the optimizer step")
    optimizer = profile_optimizer(model, dtype=dtype, device=device, threads=threads, warmup=warmup,
                                  runs=runs)
    comm = None
    if comm_ranks:
        step(f"measuring gloo collectives over {', '.join(map(str, comm_ranks))} ranks")
        kwargs = {} if comm_sizes is None else {"sizes": comm_sizes}
        comm = comm_profile(measure_collectives(ranks=comm_ranks, **kwargs), backend="gloo")
    measured_overhead = None
    if overhead:
        from medley.profile.overhead import measure_overhead

        step("measuring the runtime's overhead per action and per transfer")
        measured_overhead = measure_overhead(dtype=dtype, comm=comm, runs=runs)
    return Profile(
        format=PROFILE_FORMAT, version=PROFILE_VERSION,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=socket.gethostname(), device_type=name, device_kind=device, device_detail=_device_detail(device),
        torch_version=torch.__version__, dtype=dtype, threads=threads, model=model_dict(model), layers=layers,
        comm=comm, optimizer=optimizer, overhead=measured_overhead, compiled=compiled,
        notes=f"times: medians of the faster half of {runs} runs after {warmup} warm-up runs; torch threads "
              f"{threads}; load average when done {_loadavg()}",
    )
