"""Megatron-style tensor parallelism of a stage's blocks, with torch's ``parallelize_module``.

Per block (as torchtitan's LLaMA, without sequence parallelism): attention q/k/v and the MLP's
gate/up column-wise (each TP rank holds ``num_heads / tp`` query heads, ``num_kv_heads / tp``
KV heads and ``ffn / tp`` MLP columns), the attention output and MLP down projections
row-wise: one all-reduce after attention and one after the MLP in forward, and in backward one on
each of the two block-input gradients (the column-wise layers' replicated inputs). Norms, the
embedding and the head stay plain tensors, the same on every TP rank: their inputs and output
gradients are whole (replicated) on each, so their gradients agree and need no TP reduction.

With sequence parallelism (``sequence_parallel``, torchtitan's LLaMA plan) the hidden states
between the sub-layers are cut along the sequence over the TP group: the norms run on 1/tp of the
tokens (torch's ``SequenceParallel``; their weights become replicated DTensors whose gradients
DTensor sums over the group), the attention and the MLP all-gather their input (``Shard(1)`` to
``Replicate``) and their row-wise layers reduce-scatter their output (``Shard(1)``): per block one
all-gather and one reduce-scatter after each sub-layer in forward, the same pair in backward,
instead of Megatron's two all-reduces each way. At a stage's edges (:func:`apply_sequence_edges`)
the first block takes its input whole (the embedding's output, a hop from a group of another
degree) and keeps its sequence shard, and the last block all-gathers its output, except across
an edge :func:`medley.plan.layout.sequence_sharded_edges` names, where the neighbouring stage has
blocks on a group of the same degree: there the shard itself crosses (1/tp of the bytes, no
gather).

Blocks are split on the meta device (``src_data_rank=None``: nothing is broadcast); each TP rank
then fills only its own slice, from the seeded initialisation or a checkpoint
(:mod:`medley.runtime.materialize`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from medley.plan.layout import PlanLayout, tp_undivided
from medley.runtime.lora import LORA_A, LORA_B, LoraLinear
from medley.runtime.transformer import Decoder
from medley.spec.adapter import ROWWISE

TP_DIM = "tp"


def block_plan(swiglu: bool, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The parallel style of each layer of a block (by its name inside the block).

    The attention and the MLP take their input as one replicated DTensor, which their
    column-wise layers share: the backward sums those layers' partial input gradients and
    all-reduces once per sub-layer (Megatron's two per block). Left to ColwiseParallel alone, each
    of q, k, v, gate and up made its own and all-reduced its own gradient: five per block
    (tests/runtime/test_tp_bytes.py counts them). With ``sequence_parallel`` that input arrives
    cut on the sequence from the norm (``SequenceParallel``) and is all-gathered once per
    sub-layer (its gradient reduce-scattered once), and the row-wise layers reduce-scatter their
    output to the sequence shard (the module docstring)."""
    held = Shard(1) if sequence_parallel else Replicate()

    def shared(inputs: int = 1) -> PrepareModuleInput:
        # Attention's second input: packed sequences' positions and mask (or None), left as they are.
        rest = (None,) * (inputs - 1)
        return PrepareModuleInput(input_layouts=(held, *rest), desired_input_layouts=(Replicate(), *rest),
                                  use_local_output=False)

    def rowwise() -> RowwiseParallel:
        return RowwiseParallel(output_layouts=held)

    plan: dict[str, ParallelStyle] = {
        "attn": shared(inputs=2), "mlp": shared(),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": rowwise(), "mlp.up": ColwiseParallel(), "mlp.down": rowwise(),
    }
    if swiglu:
        plan["mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        plan["attn_norm"] = SequenceParallel()
        plan["mlp_norm"] = SequenceParallel()
    return plan


def parallelize_blocks(module: Decoder, tp_mesh: DeviceMesh, *,
                       layers: Collection[int] | None = None, sequence_parallel: bool = False) -> None:
    """Shard every block of ``module`` (those among the global layer indices ``layers``, if given)
    over ``tp_mesh`` (a 1-D mesh named ``tp``), in place; with ``sequence_parallel`` the
    sequence-parallel plan (:func:`block_plan`; then :func:`apply_sequence_edges` once per stage)."""
    if tp_mesh.size() == 1:
        return
    spec = module.spec
    undivided = tp_undivided(spec, tp_mesh.size())
    if undivided is not None:
        raise ValueError(f"TP degree {tp_mesh.size()} does not divide the model's {undivided}")
    for key, block in module.blocks.items():
        if layers is None or int(key) + 1 in layers:
            plan = block_plan(spec.mlp == "swiglu", sequence_parallel=sequence_parallel)
            parallelize_module(block, tp_mesh, plan, src_data_rank=None)
            place_adapters(block, tp_mesh)


def place_adapters(block: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """The LoRA adapters' placements in a tensor-parallel block (:mod:`medley.runtime.lora`): a
    column-wise layer's ``A`` replicated and ``B`` cut by output rows, a row-wise layer's ``A`` cut
    by input columns and ``B`` replicated, so that each adapter's output has its layer's placement
    (no collective of its own). On the meta device, as the layers' own weights."""
    for name, module in block.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        rowwise = name.rsplit(".", 1)[-1] in ROWWISE
        places = {LORA_A: Shard(1) if rowwise else Replicate(), LORA_B: Replicate() if rowwise else Shard(0)}
        for param_name, placement in places.items():
            param = getattr(module, param_name)
            whole = torch.empty(param.shape, dtype=param.dtype, device="meta")
            module.register_parameter(param_name, torch.nn.Parameter(
                distribute_tensor(whole, tp_mesh, [placement], src_data_rank=None)))


def apply_sequence_edges(module: Decoder, tp_mesh: DeviceMesh, *, sharded_input: bool,
                         sharded_output: bool) -> None:
    """The layouts at a sequence-parallel stage's edges (the module docstring): its first block
    cuts a whole input to its sequence shard (forward: no communication; backward: the gradient
    all-gathered whole) unless ``sharded_input`` (the previous stage sent the shard), and its last
    block all-gathers its output (backward: each rank keeps its shard of the whole gradient)
    unless ``sharded_output``. A stage without blocks, or on a mesh of one, is left alone."""
    if tp_mesh.size() == 1 or not module.blocks:
        return
    keys = list(module.blocks)
    if not sharded_input:
        parallelize_module(module.blocks[keys[0]], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
    if not sharded_output:
        parallelize_module(module.blocks[keys[-1]], tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``tensor``: a DTensor's local piece (its TP slice, FSDP2's
    padded shard of it: writes to it fill the DTensor), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_tp_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter or its gradient, FSDP-sharded or not) is cut over a TP mesh:
    each TP rank then holds other values, where a replicated one (a plain tensor, or a norm's
    weight under sequence parallelism: a DTensor replicated on ``tp``) is the same on all of them."""
    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return TP_DIM in names and not tensor.placements[names.index(TP_DIM)].is_replicate()


def tp_synced_stages(layout: PlanLayout) -> frozenset[int]:
    """The stages whose TP group meets in all-reduces in every forward and backward: those with a
    block (the layers :func:`parallelize_blocks` shards) on more than one device."""
    model = layout.model
    return frozenset(s for s in range(layout.num_stages) if layout.stage_tp(s) > 1
                     and any(model.layer_kind(i) == "block" for i in layout.layer_range(s)))


def replicate_partial_grads(params: Collection[torch.nn.Parameter]) -> None:
    """Sum over the TP group the gradients DTensor left partial: a sequence-parallel norm's weight
    (replicated) gets from each TP rank the sum over its tokens only (``Partial``). FSDP2
    (ZeRO-1/2/3) redistributes these itself; a ZeRO-0 stage calls this at its REDUCE_GRAD, before
    its DP all-reduce and the gradient norm. One all-reduce of the weight per such norm and step."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=param.placements)
