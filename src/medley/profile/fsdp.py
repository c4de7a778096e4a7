"""What FSDP2 adds to a layer's compute: forward and fused backward of the layer wrapped as the
runtime wraps ZeRO-2/3 stages (``fully_shard``, gradient sync off, kept gathered), on a
one-rank process group so that no communication is timed, only FSDP's hooks and bookkeeping.

The runtime's ZeRO-2/3 stages run every forward and backward through these hooks; on small CPU
layers they cost as much as the math (measured: about 1.6x a tiny block's F and BW).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from medley.profile.layer_build import build_layer, layer_inputs, one_rank_group, time_forward_backward
from medley.spec.model import ModelSpec


def measure_fsdp(model: ModelSpec, kind: str, *, micro_batch_size: int, seq_len: int,
                 dtype: torch.dtype = torch.float32, warmup: int = 2, runs: int = 5,
                 compiled: bool = False) -> tuple[float, float]:
    """(forward, fused backward) medians of the layer under FSDP2 on CPU (``compiled``: a block
    compiled as ``--compile`` does, before FSDP2 as in the runtime)."""
    device = torch.device("cpu")
    with one_rank_group():
        layer = build_layer(model, kind, dtype, device, compiled=compiled)
        unit = fully_shard(layer.module, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)
        unit.set_requires_gradient_sync(False)
        unit.set_reshard_after_backward(False)
        x, targets = layer_inputs(model, kind, micro_batch_size, seq_len, dtype, device)
        return time_forward_backward(layer, x, targets, device, warmup=warmup, runs=runs)
