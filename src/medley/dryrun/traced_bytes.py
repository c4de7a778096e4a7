"""The bytes of a rank's built stages, counted on fake storage and as the memory model books them.

Counted: the distinct storages the stage's tensors use (FSDP2's padded shards as allocated, views
of one storage once): its parameters (the stepped shards, and at ZeRO-1/2 the gathered weights),
the optimizer's state, the unsharded gradient after one micro-batch's backward, the gradient shard
after the reduce-scatter, ZeRO-3's weights gathered for compute, and the tensors autograd saves for
the backward (one micro-batch's activations). Predicted: :func:`medley.cost.zero_memory.
stage_state_bytes` over :func:`medley.cost.formulas.stage_held_params` of each stage (one TP rank),
as the compiler books them for the simulator; the model's fp32 master in half precision (4 B of its
12 B of optimizer state) is a parameter here, as torch holds it (:func:`predicted`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from medley.cost import formulas
from medley.cost.zero_levels import fsdp_units
from medley.cost.zero_memory import FP32_BYTES, frozen_state_bytes, stage_state_bytes, state_bytes_per_param
from medley.lowering.activations import stage_activation_bytes
from medley.plan.layout import PlanLayout, sequence_sharded_edges
from medley.runtime.optim import ensure_state
from medley.runtime.sharding import TORCH_DTYPES, ShardedStage
from medley.runtime.tensor_parallel import local_tensor
from medley.runtime.torch_adapter import fsdp_unsharded_grads, storage_id
from medley.runtime.transformer import token_loss_sum

TOLERANCE = 0.02
"""Built and predicted bytes may differ by this share of the prediction."""

FIGURES = ("parameters", "optimizer", "gradient", "grad_shard", "gathered")
"""The compared figures of :class:`StateFigures`, as the command names them."""


@dataclass(frozen=True, kw_only=True)
class StateFigures:
    """Model-state bytes of one rank (all its stages).

    Attributes:
        parameters: held all step: the parameters (ZeRO 1-3: FSDP2's sharded fp32 parameters, and at
            levels 1-2 the gathered weights in the compute dtype).
        optimizer: held all step: the optimizer's state (AdamW's two moments).
        gradient: after a backward: the unsharded gradient autograd makes.
        grad_shard: after the reduce-scatter (levels 1-3): the reduced gradient shard.
        gathered: level 3 only: the weights gathered in the compute dtype for compute.
    """

    parameters: float
    optimizer: float
    gradient: float
    grad_shard: float
    gathered: float

    @property
    def static(self) -> float:
        """Held between steps: parameters and optimizer state."""
        return self.parameters + self.optimizer

    def __add__(self, other: StateFigures) -> StateFigures:
        return StateFigures(**{name: getattr(self, name) + getattr(other, name) for name in FIGURES})


ZERO_FIGURES = StateFigures(parameters=0.0, optimizer=0.0, gradient=0.0, grad_shard=0.0, gathered=0.0)


def predicted(layout: PlanLayout, stages: Sequence[int]) -> StateFigures:
    """The memory model's bytes of one TP rank of ``stages`` of ``layout``, in the columns of
    :class:`StateFigures`: the fp32 weights the optimizer steps in half precision move from the
    model's optimizer state to the parameters (4 B of its 12). A LoRA layout's frozen base is
    :func:`~medley.cost.zero_memory.frozen_state_bytes`' (parameters and gathered weights only)."""
    per_param = state_bytes_per_param(layout.dtype)
    total = ZERO_FIGURES
    for stage in stages:
        layers = layout.layer_range(stage)
        params = formulas.stage_held_params(layout.model, layers.start, layers.stop,
                                            tp=layout.stage_tp(stage))
        level, dp = layout.zero[stage].level, layout.zero_dp
        if layout.adapter is not None:
            frozen = frozen_state_bytes(params, level=level, dp=dp, per_param=per_param)
            total = total + StateFigures(parameters=frozen.weights, optimizer=0.0, gradient=0.0,
                                         grad_shard=0.0, gathered=frozen.gathered_weights)
            params = formulas.stage_adapter_params(layout.model, layout.adapter, layers.start, layers.stop,
                                                   tp=layout.stage_tp(stage))
        state = stage_state_bytes(params, level=level, dp=dp, per_param=per_param)
        stepped = params / dp if fsdp_units(level, dp) else params
        master = stepped * FP32_BYTES if per_param.master_in_optimizer else 0.0
        total = total + StateFigures(parameters=state.weights + master, optimizer=state.optimizer - master,
                                     gradient=state.gradient, grad_shard=state.grad_shard,
                                     gathered=state.gathered_weights)
    return total


def predicted_activations(layout: PlanLayout, stages: Sequence[int]) -> float:
    """The formulas' activation bytes of one micro-batch on ``stages`` (one TP rank), the figure
    the compiler books for the simulator (:func:`medley.lowering.activations.stage_activation_bytes`:
    each layer's recomputation mode, sequence parallelism, autocast's weight copies)."""
    return sum(stage_activation_bytes(layout, s) for s in stages)


class Storages:
    """Bytes of distinct storages (views of one storage count once)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = 0

    def add(self, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        local = local_tensor(tensor)
        key = storage_id(local)
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += local.untyped_storage().nbytes()


def storage_bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    counted = Storages()
    for tensor in tensors:
        counted.add(tensor)
    return counted.bytes


def _stage_input(layout: PlanLayout, index: int, stage: ShardedStage, *, sharded: bool) -> torch.Tensor:
    """Stage ``index``'s input as it receives it: tokens, hidden states, or (``sharded``: it crossed
    a sequence-sharded edge) its TP rank's sequence shard."""
    batch, seq = layout.micro_batch_size, layout.seq_len
    if stage.module.first_layer == 0:
        return torch.zeros(batch, seq, dtype=torch.long)
    if sharded:
        seq //= layout.stage_tp(index)
    return torch.zeros(batch, seq, layout.model.hidden_size, dtype=TORCH_DTYPES[layout.dtype],
                       requires_grad=True)


def _run_micro_batch(layout: PlanLayout, index: int, stage: ShardedStage, parameters: set[int], *,
                     sharded_input: bool) -> int:
    """One forward and backward of ``stage`` (fake tensors); returns the bytes autograd saved for
    the backward (the stage's output and its input included, parameters not)."""
    saved = Storages()
    saved.seen |= parameters
    x = _stage_input(layout, index, stage, sharded=sharded_input)
    autocast = (torch.autocast("cpu", dtype=TORCH_DTYPES[layout.dtype]) if layout.dtype != "fp32"
                else contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.add(t), t)[1], lambda t: t), autocast:
        out = stage.module(x)
        if stage.module.head is not None:
            out = token_loss_sum(out, torch.zeros(out.shape[:2], dtype=torch.long))
    saved.add(out)
    if x.requires_grad:
        saved.add(x)
    if out.dim() == 0:
        out.backward()
    else:
        out.backward(torch.ones_like(out))
    return saved.bytes


def count_bytes(layout: PlanLayout, stages: dict[int, ShardedStage]) -> tuple[StateFigures, int]:
    """Built figures and one micro-batch's activation bytes of every stage (fake storage)."""
    total, activations = ZERO_FIGURES, 0
    edges = sequence_sharded_edges(layout)
    for index, stage in stages.items():
        stepped = [p for bucket in stage.buckets for p in bucket]  # FSDP2's (padded) shards at levels 1-3
        held = Storages()
        for param in stepped:
            held.add(param)
        if stage.sharded and stage.meaning.gathers_after_step:
            for param in stage.weights():  # levels 1-2 hold their gathered weights all step
                held.add(param)
        for optimizer in stage.optimizers:
            ensure_state(optimizer)
        optimizer_bytes = storage_bytes([value for optimizer in stage.optimizers
                                          for state in optimizer.state.values() for value in state.values()
                                          if isinstance(value, torch.Tensor) and value.dim() > 0])
        gathered = 0
        if stage.sharded and stage.meaning.gathers_for_compute:  # level 3 gathers for compute only
            stage.unshard(None)
            gathered = storage_bytes(stage.weights())
        weights = Storages()
        for param in [*stepped, *stage.weights()]:
            weights.add(param)
        activations += _run_micro_batch(layout, index, stage, weights.seen, sharded_input=index - 1 in edges)
        gradient = storage_bytes([g for unit in stage.fsdp_units for g in fsdp_unsharded_grads(unit)]
                                  if stage.sharded else [p.grad for p in stage.weights()])
        grad_shard = 0
        if stage.sharded and stage.replicated:
            stage.reduce_grad(None)
            grad_shard = storage_bytes([p.grad for p in stepped])
        if stage.sharded and stage.meaning.gathers_for_compute:
            stage.reshard(None)
        total = total + StateFigures(parameters=held.bytes, optimizer=optimizer_bytes, gradient=gradient,
                                     grad_shard=grad_shard, gathered=gathered)
    return total, activations
