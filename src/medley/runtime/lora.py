"""LoRA linear layers (:mod:`medley.spec.adapter` defines the adapter; PEFT's ``LoraLayer`` is the
reference: ``y = base(x) + scale * B(A(dropout(x)))``).

:class:`LoraLinear` is an ``nn.Linear`` holding its adapter as two more parameters, ``lora_a``
[rank, in] and ``lora_b`` [out, rank], so that torch's tensor-parallel styles take the layer as
the linear layer it is and every name stays global (``blocks.3.attn.wq.lora_a``). Under tensor
parallelism (:func:`medley.runtime.tensor_parallel.parallelize_blocks`) a column-wise layer's
``A`` is replicated and its ``B`` cut like the weight (by output rows); a row-wise layer's ``A``
is cut like the weight (by input columns) and its ``B`` replicated: the adapter's output then has
the base output's placement (sharded, or partial before the row-wise reduction) and adds to it
with no collective of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from medley.spec.adapter import LoraSpec

LORA_A, LORA_B = "lora_a", "lora_b"


class LoraLinear(nn.Linear):
    """A linear layer with a LoRA adapter of rank ``lora.rank`` (the module docstring)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, lora: LoraSpec) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.scale = lora.scale
        self.lora_a = nn.Parameter(torch.empty(lora.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, lora.rank))
        # A float, not an nn.Dropout: torch's TP styles partition every submodule as a linear layer.
        self.dropout = lora.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        adapted = F.linear(F.linear(dropped, self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + adapted * self.scale


def linear(in_features: int, out_features: int, *, bias: bool, name: str,
           adapter: LoraSpec | None) -> nn.Linear:
    """Block linear layer ``name`` (``wq``, ..., ``down``): adapted where ``adapter`` targets it."""
    if adapter is not None and name in adapter.targets:
        return LoraLinear(in_features, out_features, bias=bias, lora=adapter)
    return nn.Linear(in_features, out_features, bias=bias)


def is_adapter_name(name: str) -> bool:
    """Whether parameter ``name`` (local or global) is an adapter's."""
    return name.endswith((f".{LORA_A}", f".{LORA_B}")) or name in (LORA_A, LORA_B)


def freeze_base(module: nn.Module, *, dtype: torch.dtype | None = None) -> None:
    """Only the adapters train: every other parameter of ``module`` stops requiring a gradient
    (after tensor parallelism, whose styles make new parameters, and before FSDP2) and, with
    ``dtype``, is held in it (the compute dtype: a frozen weight needs no fp32 master; the
    adapters keep theirs), as PEFT and torchtune hold a LoRA base."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if is_adapter_name(name):
                continue
            if dtype is not None and param.dtype != dtype:
                owner.register_parameter(name, nn.Parameter(param.detach().to(dtype), requires_grad=False))
            else:
                param.requires_grad_(False)


def adapter_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> float | torch.Tensor:
    """The initial value of adapter parameter ``name``: PEFT's (``B`` zero; ``A`` as
    ``nn.Linear`` initialises its weight, kaiming-uniform with a = sqrt(5): U(-1/sqrt(in),
    1/sqrt(in)))."""
    if name.endswith(LORA_B):
        return 0.0
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(tuple(shape), generator=gen, device="cpu") * 2 - 1) * bound
