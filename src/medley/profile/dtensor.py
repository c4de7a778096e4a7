"""What torch's tensor parallelism adds to a block's compute: forward and fused backward of the
block under ``parallelize_module`` with the runtime's plan
(:func:`medley.runtime.tensor_parallel.block_plan`), on a one-rank TP mesh so that no
communication is timed, only DTensor's dispatch around every operator (the all-reduces are the
cost model's, :mod:`medley.cost.tp_cost`). The shapes stay whole: the overhead is per
operator, not per byte. On small CPU blocks it costs more than the math (measured: a tiny block's
F 1.2 ms plain, 3.1 ms under DTensor)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from medley.profile.layer_build import build_layer, layer_inputs, one_rank_group, time_forward_backward
from medley.runtime.tensor_parallel import TP_DIM, block_plan
from medley.spec.model import ModelSpec


def measure_tp(model: ModelSpec, *, micro_batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
               warmup: int = 2, runs: int = 5, compiled: bool = False) -> tuple[float, float]:
    """(forward, fused backward) medians of a block under tensor parallelism on CPU (``compiled``:
    compiled as ``--compile`` does; traced at the first call, so with its DTensor layers)."""
    device = torch.device("cpu")
    with one_rank_group():
        layer = build_layer(model, "block", dtype, device, compiled=compiled)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(TP_DIM,))
        parallelize_module(layer.module, mesh, block_plan(model.mlp == "swiglu"), src_data_rank=None)
        x, targets = layer_inputs(model, "block", micro_batch_size, seq_len, dtype, device)
        return time_forward_backward(layer, x, targets, device, warmup=warmup, runs=runs)
