"""The layers ``medley profile`` times, built as the runtime builds them
(:mod:`medley.runtime.transformer`), with random inputs and a clock that waits for the device;
shared by the plain measurement (:mod:`medley.profile.layers`) and the wrapped ones (FSDP2,
:mod:`medley.profile.fsdp`; tensor parallelism, :mod:`medley.profile.dtensor`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from medley.profile.heap_bytes import quiet_median
from medley.runtime.torch_compile import compile_block
from medley.runtime.transformer import Block, Embedding, Head, init_layer, token_loss_sum
from medley.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfiledLayer:
    """A layer module with its way of running one forward from an input."""

    kind: str
    module: nn.Module
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_layer(model: ModelSpec, kind: str, dtype: torch.dtype, device: torch.device, *,
                compiled: bool = False) -> ProfiledLayer:
    """The layer in ``dtype``, its forward run as the runtime runs it: a half-precision one under
    ``torch.autocast`` (:class:`medley.runtime.executor.RankExecutor`), whose norms compute (and
    keep for their backward) an fp32 copy of their input. ``compiled``: a block is compiled as
    ``medley train --compile`` compiles it (:func:`medley.runtime.torch_compile.compile_block`; the
    embedding and the head stay eager there too), traced at its first (warm-up) call, so after
    any wrapper applied next."""
    layer = _build_layer(model, kind, dtype, device)
    if compiled and kind == "block":  # timed split (B, W) and fused: safe for both
        compile_block(layer.module, split_backward=True)
    if dtype == torch.float32:
        return layer
    plain = layer.forward

    def forward(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return plain(x, targets)

    return ProfiledLayer(kind=layer.kind, module=layer.module, forward=forward)


def _build_layer(model: ModelSpec, kind: str, dtype: torch.dtype, device: torch.device) -> ProfiledLayer:
    if kind == "embedding":
        module: nn.Module = Embedding(model)
        init_layer(module, 0, 0, model.num_blocks)
        return ProfiledLayer(kind=kind, module=module.to(device, dtype), forward=lambda x, _t: module(x))
    if kind == "block":
        module = Block(model)
        init_layer(module, 0, 1, model.num_blocks)
        return ProfiledLayer(kind=kind, module=module.to(device, dtype), forward=lambda x, _t: module(x))
    head = Head(model)
    init_layer(head, 0, model.num_layers - 1, model.num_blocks)
    tied = nn.Parameter(torch.randn(model.vocab_size, model.hidden_size) * 0.02) if head.out is None else None
    head = head.to(device, dtype)
    if tied is not None:
        tied = nn.Parameter(tied.to(device, dtype))
        head.register_parameter("tied_weight", tied)

    def forward(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(head(x, tied), targets) / targets.numel()

    return ProfiledLayer(kind=kind, module=head, forward=forward)


def layer_inputs(model: ModelSpec, kind: str, mbs: int, seq: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(mbs * 7919 + seq)
    targets = torch.randint(0, model.vocab_size, (mbs, seq), generator=gen).to(device)
    if kind == "embedding":
        return torch.randint(0, model.vocab_size, (mbs, seq), generator=gen).to(device), targets
    x = torch.randn(mbs, seq, model.hidden_size, generator=gen).to(device, dtype)
    return x, targets


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_forward_backward(layer: ProfiledLayer, x: torch.Tensor, targets: torch.Tensor, device: torch.device,
                          *, warmup: int, runs: int) -> tuple[float, float]:
    """(forward, fused backward) medians of ``runs`` timed repetitions after ``warmup``."""
    forward, backward = [], []
    for i in range(warmup + runs):
        inp = x if layer.kind == "embedding" else x.detach().requires_grad_(True)
        t0 = now(device)
        out = layer.forward(inp, targets)
        t1 = now(device)
        torch.autograd.backward([out], None if layer.kind == "head" else [torch.ones_like(out)])
        t2 = now(device)
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return quiet_median(forward), quiet_median(backward)


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the duration (the caller's own, if one is initialised):
    wrappers that need a mesh (FSDP2, tensor parallelism) run without any communication."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()
