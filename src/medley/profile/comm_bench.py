"""Collective micro-benchmarks over a torch.distributed backend, fitted to medley's α-β model.

Ranks are spawned on this machine (gloo on CPU). For each group size and message size: a
send/recv ping-pong between ranks 0 and 1 (half the round trip), all-gather, reduce-scatter and
all-reduce, each the median of the faster half of ``runs`` repetitions of the slowest rank's time after a
barrier (other jobs on a shared machine only add time).
``nbytes`` is always the full buffer, as :class:`medley.cost.interfaces.CommModel` counts it.

The fit uses the formulas of :class:`medley.cost.comm.TopologyCommModel` inside one node, so the
fitted link, put into a cluster, makes the simulator time these operations as measured:

    send/recv       α + N/β
    all-gather      (n-1)·α + (n-1)/n · N/β        (reduce-scatter the same)
    all-reduce      2·[(n-1)·α + (n-1)/n · N/β]

α and 1/β come from a non-negative least-squares fit weighted by 1/t (relative errors count).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy.optimize import nnls

from medley.cost.profile_format import AlphaBeta, CommMeasurement, CommProfile
from medley.launch.nodes import free_port
from medley.profile.heap_bytes import quiet_median
from medley.runtime.torch_adapter import all_gather_single, reduce_scatter_single

OPS = ("send_recv", "all_gather", "reduce_scatter", "all_reduce")
DEFAULT_SIZES = (4 << 10, 32 << 10, 256 << 10, 2 << 20, 8 << 20)


def ring_terms(op: str, ranks: int) -> tuple[float, float]:
    """(latency steps, fraction of N on the wire per rank) of ``op`` over ``ranks`` in the model."""
    if op == "send_recv":
        return 1.0, 1.0
    steps, share = ranks - 1.0, (ranks - 1.0) / ranks
    return (2 * steps, 2 * share) if op == "all_reduce" else (steps, share)


def model_time(op: str, ranks: int, nbytes: float, fit: AlphaBeta) -> float:
    steps, share = ring_terms(op, ranks)
    return steps * fit.latency_s + share * nbytes / fit.bandwidth_bytes_per_s


def fit_alpha_beta(measurements: Sequence[CommMeasurement]) -> AlphaBeta:
    """Least-squares α, β of the ring model over ``measurements`` (relative errors)."""
    if not measurements:
        raise ValueError("fit_alpha_beta needs at least one measurement")
    rows = [ring_terms(m.op, m.ranks) for m in measurements]
    times = np.array([m.seconds for m in measurements])
    design = np.array(
        [[steps, share * m.nbytes] for (steps, share), m in zip(rows, measurements, strict=True)]
    )
    weights = 1.0 / times
    solution, _ = nnls(design * weights[:, None], times * weights)
    latency, inverse_bandwidth = float(solution[0]), float(solution[1])
    bandwidth = 1.0 / inverse_bandwidth if inverse_bandwidth > 0 else 1e15
    fit = AlphaBeta(latency_s=latency, bandwidth_bytes_per_s=bandwidth, median_rel_error=0.0)
    errors = [abs(model_time(m.op, m.ranks, m.nbytes, fit) - m.seconds) / m.seconds for m in measurements]
    return fit.model_copy(update={"median_rel_error": float(statistics.median(errors))})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], *, runs: int, warmup: int, group: dist.ProcessGroup | None,
           device: torch.device) -> float:
    """Median of the faster half over ``runs`` of the slowest rank's time of ``fn`` (after a
    barrier of ``group``; on CUDA from an idle device to an idle device)."""
    samples = []
    for i in range(warmup + runs):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            samples.append(float(elapsed.item()))
    return quiet_median(samples)


def _ops(rank: int, ranks: Sequence[int], group: dist.ProcessGroup | None, full: torch.Tensor,
         shard: torch.Tensor, *, pair: bool) -> dict[str, Callable[[], object]]:
    first, second = ranks[0], ranks[1]

    def ping_pong() -> None:  # half of it is one send/recv; the group's other ranks wait
        if rank == first:
            dist.send(full, second)
            dist.recv(full, second)
        elif rank == second:
            dist.recv(full, first)
            dist.send(full, first)

    ops: dict[str, Callable[[], object]] = {"send_recv": ping_pong} if pair else {}
    return {
        **ops,
        "all_gather": lambda: all_gather_single(full, shard, group=group),  # what FSDP2 issues
        "reduce_scatter": lambda: reduce_scatter_single(shard, full, group=group),
        "all_reduce": lambda: dist.all_reduce(full, group=group),
    }


def measure_group(rank: int, ranks: Sequence[int], *, group: dist.ProcessGroup | None, sizes: Sequence[int],
                  runs: int, warmup: int, device: torch.device, pair: bool = True) -> list[dict]:
    """Collective, on the members of ``group`` (global ``ranks``; None: the world): every op of
    :data:`OPS` at every size (``pair``: with the send/recv ping-pong between its first two ranks),
    as rows of :class:`~medley.cost.profile_format.CommMeasurement`'s fields."""
    size, out = len(ranks), []
    for nbytes in sizes:
        elements = max(size, nbytes // 4 // size * size)
        full = torch.ones(elements, device=device)
        shard = torch.ones(elements // size, device=device)
        for op, fn in _ops(rank, ranks, group, full, shard, pair=pair).items():
            seconds = _timed(fn, runs=runs, warmup=warmup, group=group, device=device)
            seconds /= 2 if op == "send_recv" else 1
            out.append(dict(op=op, ranks=size if op != "send_recv" else 2, nbytes=float(elements * 4),
                            seconds=seconds))
    return out


def _worker(rank: int, world: int, port: int, sizes: list[int], runs: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        rows = measure_group(rank, range(world), group=None, sizes=sizes, runs=runs, warmup=warmup,
                             device=torch.device("cpu"), pair=world == 2)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure_collectives(*, ranks: Sequence[int] = (2, 4), sizes: Sequence[int] = DEFAULT_SIZES,
                        runs: int = 7, warmup: int = 2) -> list[CommMeasurement]:
    """Spawn each group size on gloo and time every op at every size."""
    rows: list[CommMeasurement] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in ranks:
            out = Path(tmp) / f"comm_{world}.json"
            mp.start_processes(_worker, args=(world, free_port(), list(sizes), runs, warmup, str(out)),
                               nprocs=world, join=True, start_method="spawn")
            rows += [CommMeasurement(**row) for row in json.loads(out.read_text())]
    return rows


def comm_profile(measurements: Sequence[CommMeasurement], backend: str = "gloo") -> CommProfile:
    """Per-op fits and one fit over every op (the cluster link)."""
    fits = {op: fit_alpha_beta([m for m in measurements if m.op == op])
            for op in OPS if any(m.op == op for m in measurements)}
    by_ranks = {str(n): fit_alpha_beta([m for m in measurements if m.ranks == n])
                for n in sorted({m.ranks for m in measurements})}
    return CommProfile(backend=backend, measurements=list(measurements), fits=fits,
                       link=fit_alpha_beta(measurements), link_by_ranks=by_ranks)
