"""Measure each layer kind of a model: F, B, W and fused backward times, and activation bytes.

The layers are the runtime's own modules (:mod:`medley.runtime.transformer`), and the backward is
split exactly as the runtime splits it (:mod:`medley.runtime.torch_adapter`): B computes the
input gradient and keeps what W needs, W the weight gradients. The embedding takes token ids,
which carry no gradient, so (as in the runtime and in torch) its B is empty and its whole
backward runs at W. The head's forward includes the loss, as on the runtime's last stage.

Each time is the median of the faster half of ``runs`` timed repetitions (other jobs on a shared
machine only add time) after ``warmup`` untimed ones, with
torch pinned to ``threads`` threads (the runtime's ranks run one thread each on CPU). Activation
bytes are what the forward leaves alive until the backward, and what is still alive between B and
W: on CPU the exact storage bytes (as the runtime's memory probe counts them), on CUDA allocator
deltas.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import nnls

from medley.cost.profile_format import LayerMeasurement, OptimizerProfile
from medley.profile.heap_bytes import allocated_bytes, quiet_median
from medley.profile.layer_build import ProfiledLayer, build_layer, layer_inputs, now
from medley.runtime.optim import optimizer_class
from medley.runtime.sharding import TORCH_DTYPES
from medley.runtime.torch_adapter import backward_input, backward_weight
from medley.spec.model import ModelSpec


def _memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return allocated_bytes() or 0


@dataclass(kw_only=True)
class _Run:
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    activation_bytes: float
    activation_after_b_bytes: float


def _split_run(layer: ProfiledLayer, x: torch.Tensor, targets: torch.Tensor, device: torch.device) -> _Run:
    """One F, then B, then W, timed and with the live bytes after F and after B."""
    weights = list(layer.module.parameters())
    layer.module.zero_grad(set_to_none=False)  # gradients exist, as they do after the first step
    inp = x if layer.kind == "embedding" else x.detach().requires_grad_(True)
    base = _memory(device)
    t0 = now(device)
    out = layer.forward(inp, targets)
    t1 = now(device)
    after_f = _memory(device)
    grad = None if layer.kind == "head" else torch.ones_like(out)
    held = _memory(device) - after_f  # the output gradient, which arrives from the next stage
    t2 = now(device)
    if layer.kind == "embedding":
        state = None  # token ids carry no gradient: everything happens at W
    else:
        dinputs, state = backward_input([out], None if grad is None else [grad], [inp], weights)
    t3 = now(device)
    if state is not None:  # the input gradient leaves for the previous stage
        inp.grad = None
        del dinputs
    after_b = _memory(device) - held
    del grad
    t4 = now(device)
    if state is None:
        torch.autograd.backward([out], [torch.ones_like(out)])
    else:
        backward_weight(weights, state)
    t5 = now(device)
    del out, state
    return _Run(forward_s=t1 - t0, backward_input_s=t3 - t2, backward_weight_s=t5 - t4,
                activation_bytes=max(0.0, after_f - base),
                activation_after_b_bytes=max(0.0, after_b - base))


def measure_live_activations(
    layer: ProfiledLayer, x: torch.Tensor, targets: torch.Tensor
) -> tuple[float, float]:
    """(bytes F leaves alive, bytes still alive between B and W): the exact sizes of the tensor
    storages they create, as the runtime's CPU probe counts them (:mod:`medley.runtime.memory`;
    the C allocator's in-use figure also counts its page rounding, some 5% more)."""
    from medley.runtime.memory import LiveTensorBytes

    weights = list(layer.module.parameters())
    layer.module.zero_grad(set_to_none=False)  # gradients exist, as they do after the first step
    inp = x if layer.kind == "embedding" else x.detach().requires_grad_(True)
    # Storages that exist already (weights, their gradients, the input) count in no layer's
    # activations, views of them made during the forward neither.
    tracker = LiveTensorBytes([*weights, *(w.grad for w in weights if w.grad is not None), x, inp])
    base = tracker.live()
    with tracker:
        out = layer.forward(inp, targets)
        after_f = tracker.live() - base
        grad = None if layer.kind == "head" else torch.ones_like(out)
        held = tracker.live() - base - after_f  # the output gradient, which arrives from the next stage
        state = None
        if layer.kind != "embedding":  # token ids carry no gradient: everything happens at W
            dinputs, state = backward_input([out], None if grad is None else [grad], [inp], weights)
            inp.grad = None  # the input gradient leaves for the previous stage
            del dinputs
        after_b = tracker.live() - base - held if state is not None else after_f
        del grad, out, state
    return float(after_f), float(after_b)


def _backward_workspace(layer: ProfiledLayer, x: torch.Tensor, targets: torch.Tensor) -> float:
    """Peak live bytes during F and the fused backward beyond what F leaves alive (temporaries and
    gradients of intermediates), the way the runtime's CPU probe (medley.runtime.memory) counts them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(layer.module)
    with tracker:
        inp = x if layer.kind == "embedding" else x.detach().requires_grad_(True)
        out = layer.forward(inp, targets)
        after_forward = tracker.get_tracker_snapshot("current")
        grad = None if layer.kind == "head" else torch.ones_like(out)
        torch.autograd.backward([out], None if grad is None else [grad])
        peak = tracker.get_tracker_snapshot("peak")

    def total(snapshot: dict) -> float:
        return float(max((usage.get("Total", 0) for usage in snapshot.values()), default=0))

    return max(0.0, total(peak) - total(after_forward))


def _fused_run(layer: ProfiledLayer, x: torch.Tensor, targets: torch.Tensor, device: torch.device) -> float:
    inp = x if layer.kind == "embedding" else x.detach().requires_grad_(True)
    out = layer.forward(inp, targets)
    grad = None if layer.kind == "head" else torch.ones_like(out)
    t0 = now(device)
    torch.autograd.backward([out], None if grad is None else [grad])
    return now(device) - t0


def measure_layer(model: ModelSpec, kind: str, *, micro_batch_size: int, seq_len: int, dtype: str = "fp32",
                  device: str = "cpu", warmup: int = 2, runs: int = 5,
                  compiled: bool = False) -> LayerMeasurement:
    """Medians of ``runs`` repetitions of one layer kind at one shape; ``compiled``: a block
    compiled as ``medley train --compile`` compiles it (see :func:`profile_layers`)."""
    dev = torch.device(device)
    layer = build_layer(model, kind, TORCH_DTYPES[dtype], dev, compiled=compiled)
    x, targets = layer_inputs(model, kind, micro_batch_size, seq_len, TORCH_DTYPES[dtype], dev)
    for _ in range(warmup):
        _split_run(layer, x, targets, dev)
        _fused_run(layer, x, targets, dev)
    split = [_split_run(layer, x, targets, dev) for _ in range(runs)]
    fused = [_fused_run(layer, x, targets, dev) for _ in range(runs)]
    # The CPU byte counts run under torch dispatch modes, which dynamo does not trace: a compiled
    # block's are counted on the same block eager (what inductor's graph saves is not measured).
    counted = build_layer(model, kind, TORCH_DTYPES[dtype], dev) if compiled and kind == "block" else layer
    workspace = _backward_workspace(counted, x, targets) if dev.type == "cpu" else 0.0
    live = measure_live_activations(counted, x, targets) if dev.type == "cpu" else None
    fsdp_forward = fsdp_backward = tp_forward = tp_backward = None
    if dev.type == "cpu":
        from medley.profile.dtensor import measure_tp
        from medley.profile.fsdp import measure_fsdp

        shape = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "dtype": TORCH_DTYPES[dtype],
                 "warmup": warmup, "runs": runs, "compiled": compiled}
        fsdp_forward, fsdp_backward = measure_fsdp(model, kind, **shape)
        if kind == "block":
            tp_forward, tp_backward = measure_tp(model, **shape)

    def median(name: str) -> float:
        values = [getattr(r, name) for r in split]
        return quiet_median(values) if name.endswith("_s") else statistics.median(values)

    return LayerMeasurement(
        kind=kind, micro_batch_size=micro_batch_size, seq_len=seq_len, forward_s=median("forward_s"),
        backward_input_s=median("backward_input_s"), backward_weight_s=median("backward_weight_s"),
        backward_full_s=quiet_median(fused),
        activation_bytes=live[0] if live else median("activation_bytes"),
        activation_after_b_bytes=live[1] if live else median("activation_after_b_bytes"),
        backward_workspace_bytes=workspace,
        fsdp_forward_s=fsdp_forward, fsdp_backward_full_s=fsdp_backward, tp_forward_s=tp_forward,
        tp_backward_full_s=tp_backward, runs=runs,
    )


def profile_layers(model: ModelSpec, *, micro_batch_sizes: Sequence[int], seq_lens: Sequence[int],
                   dtype: str = "fp32", device: str = "cpu", threads: int = 1, warmup: int = 2,
                   runs: int = 5, compiled: bool = False) -> list[LayerMeasurement]:
    """Every layer kind of ``model`` at every (micro-batch size, sequence length).

    ``compiled``: blocks are compiled (:func:`medley.runtime.torch_compile.compile_block`, as for a
    zero-bubble rank, since both the split and the fused backward are timed) and timed after their
    warm-up, which compiles them. Their split backward (B then W, reusing the graph) runs the
    compiled backward graph twice, so B + W is about twice the fused backward, as in the runtime;
    AOTAutograd's buffer donation is off while they are measured (restored after)."""
    import torch._functorch.config as functorch_config

    previous = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    try:
        with functorch_config.patch(donated_buffer=not compiled):
            return [
                measure_layer(model, kind, micro_batch_size=mbs, seq_len=seq, dtype=dtype, device=device,
                              warmup=warmup, runs=runs, compiled=compiled)
                for seq in seq_lens for mbs in micro_batch_sizes for kind in ("embedding", "block", "head")
            ]
    finally:
        torch.set_num_threads(previous)


def profile_optimizer(model: ModelSpec, *, dtype: str = "fp32", device: str = "cpu", threads: int = 1,
                      warmup: int = 2, runs: int = 5) -> OptimizerProfile:
    """The runtime's AdamW step time (:func:`medley.runtime.optim.optimizer_class`) over each layer
    kind's parameters, fitted as fixed + per-parameter cost."""
    previous = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    dev = torch.device(device)
    points: list[tuple[int, float]] = []
    try:
        for kind in ("embedding", "block", "head"):
            params = list(build_layer(model, kind, TORCH_DTYPES[dtype], dev).module.parameters())
            for param in params:
                param.grad = torch.randn_like(param) * 1e-3
            adamw, kwargs = optimizer_class("adamw", lr=1e-4, weight_decay=0.1, device=dev)
            optimizer = adamw(params, **kwargs)
            samples = []
            for i in range(warmup + runs):
                t0 = now(dev)
                optimizer.step()
                if i >= warmup:
                    samples.append(now(dev) - t0)
            points.append((sum(p.numel() for p in params), quiet_median(samples)))
    finally:
        torch.set_num_threads(previous)
    sizes = np.array([float(n) for n, _ in points])
    times = np.array([t for _, t in points])
    design = np.stack([np.ones_like(sizes), sizes], axis=1) / times[:, None]  # relative errors
    (fixed, per_param), _ = nnls(design, np.ones_like(times))
    return OptimizerProfile(name="AdamW", fixed_s=float(fixed), per_param_s=float(per_param),
                            measurements=points)
