"""Megatron-style tensor parallelism of a stage's blocks, with torch's ``parallelize_module``.

Per block (as torchtitan's LLaMA, without sequence parallelism): attention q/k/v and the MLP's
gate/up column-wise (each TP rank holds ``num_heads / tp`` query heads, ``num_kv_heads / tp``
KV heads and ``ffn / tp`` MLP columns), the attention output and MLP down projections
row-wise: one all-reduce after attention and one after the MLP in forward, and in backward one on
each of the two block-input gradients (the column-wise layers' replicated inputs). Norms, the
embedding and the head stay plain tensors, the same on every TP rank: their inputs and output
gradients are whole (replicated) on each, so their gradients agree and need no TP reduction.

Blocks are split on the meta device (``src_data_rank=None``: nothing is broadcast); each TP rank
then fills only its own slice, from the seeded initialisation or a checkpoint
(:mod:`medley.runtime.materialize`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from medley.plan.layout import PlanLayout, tp_undivided
from medley.runtime.model import Decoder

TP_DIM = "tp"


def block_plan(swiglu: bool) -> dict[str, ColwiseParallel | RowwiseParallel | PrepareModuleInput]:
    """The parallel style of each linear layer of a block (by its name inside the block).

    The attention and the MLP take their input as one replicated DTensor, which their
    column-wise layers share: the backward sums those layers' partial input gradients and
    all-reduces once per sub-layer (Megatron's two per block). Left to ColwiseParallel alone, each
    of q, k, v, gate and up made its own and all-reduced its own gradient: five per block
    (tests/runtime/test_tp_bytes.py counts them)."""
    def shared() -> PrepareModuleInput:
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                  use_local_output=False)

    plan: dict[str, ColwiseParallel | RowwiseParallel | PrepareModuleInput] = {
        "attn": shared(), "mlp": shared(),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
    }
    if swiglu:
        plan["mlp.gate"] = ColwiseParallel()
    return plan


def parallelize_blocks(module: Decoder, tp_mesh: DeviceMesh, *,
                       layers: Collection[int] | None = None) -> None:
    """Shard every block of ``module`` (those among the global layer indices ``layers``, if given)
    over ``tp_mesh`` (a 1-D mesh named ``tp``), in place."""
    if tp_mesh.size() == 1:
        return
    spec = module.spec
    undivided = tp_undivided(spec, tp_mesh.size())
    if undivided is not None:
        raise ValueError(f"TP degree {tp_mesh.size()} does not divide the model's {undivided}")
    for key, block in module.blocks.items():
        if layers is None or int(key) + 1 in layers:
            parallelize_module(block, tp_mesh, block_plan(spec.mlp == "swiglu"), src_data_rank=None)


def is_tp_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter or its gradient, FSDP-sharded or not) is cut over a TP mesh:
    each TP rank then holds other values, where a replicated one is the same on all of them."""
    return isinstance(tensor, DTensor) and TP_DIM in (tensor.device_mesh.mesh_dim_names or ())


def tp_synced_stages(layout: PlanLayout) -> frozenset[int]:
    """The stages whose TP group meets in all-reduces in every forward and backward: those with a
    block (the layers :func:`parallelize_blocks` shards) on more than one device."""
    model = layout.model
    return frozenset(s for s in range(layout.num_stages) if layout.stage_tp(s) > 1
                     and any(model.layer_kind(i) == "block" for i in layout.layer_range(s)))
