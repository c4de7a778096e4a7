"""What medley's runtime pays per action beyond the profiled layers: the executor's bookkeeping per
compute action, one gloo hand-off per point-to-point transfer and FSDP2's work around each ZeRO
collective call.

The layer profile times each layer's forward and backward alone; the runtime's executor also
looks up and stores tensors, detaches inputs, enters autocast and runs its emulation and
memory hooks around every compute action, and each pipeline transfer is an ``isend`` on one rank
and a ``recv`` into a fresh buffer on the other. Neither is in the layer times nor in the α-β link,
so nearly every step-time prediction came out short (bench/results/fidelity.md). Both are measured here,
on the runtime itself:

* **per compute action**: a one-rank plan of :data:`PROBE` (a model too small to compute anything,
  so that a step is nearly all bookkeeping) trains with :data:`PROBE_MICRO_BATCHES` micro-batch
  counts; the step time's slope per micro-batch, less the probe's own profiled layer times (F and
  fused backward of every layer, the lower of a measurement before and one after the runs), over
  the two compute actions (F, BW) of a micro-batch (what the step loop does per micro-batch, the
  loss and the batch's slicing, is booked with them);
* **per hand-off**: two gloo ranks pass a small tensor back and forth exactly as the executor
  does (``isend``, ``recv`` into ``torch.empty``); half the round trip, less what the profile's
  two-rank link fit already charges for that message (when collectives were measured too);
* **per ZeRO collective call**: the probe as streamed ZeRO-3 on two ranks, one bucket per layer
  (:func:`measure_collective_overhead`).

All are clamped at 0 and stored in the profile's ``overhead`` (older profiles have none: 0). The
per-action and per-call figures are differences of timings and can come out below 0: the layer profile's
own fixed cost per layer pass (timers, allocator queries) then already covers the executor's;
``figures["residual_per_action_s"]`` and ``figures["residual_per_collective_s"]`` keep the
signed values.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from medley.cost.profile_format import CommProfile, OverheadProfile
from medley.profile.heap_bytes import quiet_median
from medley.spec.model import ModelSpec

# As small as the runtime allows (the synthetic data needs 256 token ids): next to no math.
PROBE = ModelSpec(
    name="overhead-probe",
    vocab_size=256,
    hidden_size=8,
    num_blocks=1,
    num_heads=1,
    num_kv_heads=1,
    ffn_hidden_size=8,
    mlp="swiglu",
    norm="rmsnorm",
    position="rope",
    max_seq_len=8,
    tied_embeddings=False,
    bias=False,
)
PROBE_SEQ_LEN = 4
PROBE_MICRO_BATCHES = (2, 10)
HANDOFF_BYTES = 4096  # a small activation: the hand-off, not the bandwidth


def _probe_plan(micro_batches: int, dtype: str, *, dp: int = 1, streamed_zero3: bool = False):  # -> Plan
    """The probe on ``dp`` CPU ranks; ``streamed_zero3``: one ZeRO-3 bucket per layer, gathered
    before and reduced after every compute action (imported late: the planner is heavy)."""
    from medley.cost.estimator import CatalogCostSource
    from medley.plan.inline import inline_layout
    from medley.plan.plan import Plan
    from medley.spec.catalog import CPU_DEVICE_TYPE
    from medley.spec.cluster_load import cluster_from_dict

    cluster = cluster_from_dict(
        {"name": "overhead-probe", "nodes": [{"name": "rank0", "device": CPU_DEVICE_TYPE, "count": dp}]},
        source="overhead probe",
    )
    cost = CatalogCostSource.for_cluster(PROBE, cluster, dtype="fp32")
    layout = inline_layout(
        cluster=cluster,
        model=PROBE,
        cost=cost,
        pp=1,
        dp=dp,
        schedule="1f1b",
        micro_batches=",".join([str(micro_batches)] * dp),
        micro_batch_size=1,
        seq_len=PROBE_SEQ_LEN,
        zero="3" if streamed_zero3 else "0",
        buckets=PROBE.num_layers if streamed_zero3 else 1,
        gather_windows=0 if streamed_zero3 else 1,
        dtype=dtype,
    )
    return Plan(layout=layout, cluster=cluster, prediction=None)


def _step_time(
    micro_batches: int, *, dtype: str, steps: int, dp: int = 1, streamed_zero3: bool = False
) -> float:
    """Median step time of the probe plan over ``steps`` steps after as many warm-up steps."""
    from medley.launch.spawn import train_local
    from medley.runtime.train import TrainConfig

    config = TrainConfig.of(
        steps=2 * steps, clip_norm=None, data="synthetic", progress=False, dtype=dtype, warmup_steps=0
    )
    plan = _probe_plan(micro_batches, dtype, dp=dp, streamed_zero3=streamed_zero3)
    records = train_local(plan, config)
    return quiet_median([r.step_time_s for r in records[steps:]])


def _probe_slope(
    layers_s: Callable[[], float], step_time: Callable[[int], float]
) -> tuple[dict[int, float], float, float]:
    """(step time per probe micro-batch count, the probe's layer seconds, the step's slope per
    micro-batch). The layers are timed before and after the runs: other work on a shared machine
    only adds time, so the lower counts."""
    low, high = PROBE_MICRO_BATCHES
    before = layers_s()
    times = {m: step_time(m) for m in (low, high)}
    return times, min(before, layers_s()), (times[high] - times[low]) / (high - low)


def measure_action_overhead(*, dtype: str = "fp32", steps: int = 10, runs: int = 9) -> tuple[float, dict]:
    """(seconds of executor bookkeeping per compute action, the figures it comes from)."""
    from medley.profile.layers import profile_layers

    def layers_s() -> float:  # F + BW of every probe layer, one micro-batch
        layers = profile_layers(
            PROBE, micro_batch_sizes=[1], seq_lens=[PROBE_SEQ_LEN], dtype=dtype, runs=runs
        )
        return sum(m.forward_s + m.backward_full_s for m in layers)

    times, layer_s, slope = _probe_slope(layers_s, lambda m: _step_time(m, dtype=dtype, steps=steps))
    residual = (slope - layer_s) / 2  # below 0 when the profile's own per-layer costs exceed the executor's
    return max(0.0, residual), {
        "step_s": {str(m): t for m, t in times.items()},
        "slope_per_micro_batch_s": slope,
        "probe_layers_s": layer_s,
        "residual_per_action_s": residual,
        # what a step costs at no micro-batch: loop, optimizer, reductions
        "step_intercept_s": times[PROBE_MICRO_BATCHES[0]] - PROBE_MICRO_BATCHES[0] * slope,
    }


def measure_collective_overhead(
    *, action_s: float, comm: CommProfile | None, dtype: str = "fp32", steps: int = 10, runs: int = 9
) -> tuple[float, dict]:
    """(seconds the runtime adds to each ZeRO collective call beyond the link fit, its figures).

    The probe runs on two ranks as streamed ZeRO-3 with one bucket per layer, so every compute
    action gathers every layer before it and every backward reduce-scatters every layer after it
    (FSDP2's copy-in, copy-out and bookkeeping around each gloo call). The step time's slope per
    micro-batch less the layers under FSDP2 (:func:`~medley.profile.fsdp.measure_fsdp`), the two
    actions' executor overhead (``action_s``) and the link fit's time for every gather and
    reduction, over the micro-batch's collective calls, is the cost per call."""
    from medley.cost import formulas
    from medley.cost.zero_memory import state_bytes_per_param
    from medley.profile.comm_bench import model_time
    from medley.profile.fsdp import measure_fsdp
    from medley.runtime.sharding import TORCH_DTYPES

    def layers_s() -> float:  # F + BW of every probe layer under FSDP2, one micro-batch
        return sum(sum(measure_fsdp(PROBE, PROBE.layer_kind(layer), micro_batch_size=1, seq_len=PROBE_SEQ_LEN,
                                    dtype=TORCH_DTYPES[dtype], runs=runs))
                   for layer in range(PROBE.num_layers))

    state = state_bytes_per_param(dtype)
    times, layer_s, slope = _probe_slope(
        layers_s, lambda m: _step_time(m, dtype=dtype, steps=steps, dp=2, streamed_zero3=True))
    link = comm.link_for(2) if comm is not None else None
    link_s = 0.0
    for layer in range(PROBE.num_layers):  # F and BW gather every layer, BW reduces it
        params = float(formulas.stage_held_params(PROBE, layer, layer + 1))
        if link is not None:
            link_s += (2 * model_time("all_gather", 2, params * state.weights, link)
                       + model_time("reduce_scatter", 2, params * state.grads, link))
    calls = 3 * PROBE.num_layers
    residual = (slope - layer_s - 2 * action_s - link_s) / calls
    return max(0.0, residual), {
        "zero3_step_s": {str(m): t for m, t in times.items()},
        "zero3_slope_per_micro_batch_s": slope,
        "zero3_probe_layers_s": layer_s,
        "zero3_link_model_s": link_s,
        "collective_calls_per_micro_batch": calls,
        "residual_per_collective_s": residual,
    }


def _handoff_worker(rank: int, port: int, trips: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        shape = (HANDOFF_BYTES // 4,)
        tensor = torch.ones(shape)
        peer = 1 - rank
        samples = []
        for i in range(rounds + 2):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(trips):
                if rank == 0:  # as RankExecutor._send and ._recv do
                    work = dist.isend(tensor, dst=peer, tag=1)
                    dist.recv(torch.empty(shape), src=peer, tag=2)
                    work.wait()
                else:
                    dist.recv(torch.empty(shape), src=peer, tag=1)
                    dist.isend(tensor, dst=peer, tag=2).wait()
            if i >= 2:
                samples.append((time.perf_counter() - t0) / trips / 2)
        if rank == 0:
            Path(out).write_text(json.dumps(samples))
    finally:
        dist.destroy_process_group()


def measure_handoff(*, trips: int = 50, rounds: int = 9) -> float:
    """Seconds of one transfer of :data:`HANDOFF_BYTES` between two gloo ranks, executor-style."""
    from medley.launch.nodes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "handoff.json"
        mp.start_processes(
            _handoff_worker,
            args=(free_port(), trips, rounds, str(out)),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        return quiet_median(json.loads(out.read_text()))


def measure_overhead(
    *, dtype: str = "fp32", comm: CommProfile | None = None, runs: int = 9, steps: int = 10
) -> OverheadProfile:
    """Both overheads; the hand-off's is what the two-rank link fit of ``comm`` does not already
    charge. ``runs``: timed repetitions per probe layer; ``steps``: timed steps per probe run."""
    from medley.profile.comm_bench import model_time

    action_s, figures = measure_action_overhead(dtype=dtype, runs=runs, steps=steps)
    handoff = measure_handoff()
    link_s = model_time("send_recv", 2, float(HANDOFF_BYTES), comm.link_for(2)) if comm is not None else 0.0
    figures |= {"handoff_s": handoff, "handoff_link_model_s": link_s, "handoff_bytes": HANDOFF_BYTES}
    collective_s, more = measure_collective_overhead(action_s=action_s, comm=comm, dtype=dtype, steps=steps,
                                                     runs=runs)
    return OverheadProfile(action_s=action_s, p2p_handoff_s=max(0.0, handoff - link_s),
                           collective_s=collective_s, figures=figures | more)
