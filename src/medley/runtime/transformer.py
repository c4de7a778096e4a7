"""A decoder-only transformer in plain torch, buildable one layer range at a time.

Layer ``0`` is the embedding, ``1..num_blocks`` the blocks and ``num_blocks + 1`` the final norm
and LM head (the loss is applied by the caller). :class:`Decoder` holds any contiguous range of
these layers, so a pipeline stage builds only its own. Every layer is initialised from a
generator seeded by ``(seed, layer index)``, so a stage's parameters are bit-identical to the
same layers of the full model: the single-process reference exists for any split. Parameter
names are global (``embed.*``, ``blocks.<block index>.*``, ``head.*``) and map 1:1 between a
stage and the full model, but for a tied model's head copy on a stage without the embedding
(``head.out.weight``, whose global name :func:`shared_name` gives as ``embed.tok.weight``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from medley.cost.recompute import SAVED_OPS, Recompute, parse_recompute
from medley.runtime.lora import adapter_init, is_adapter_name, linear
from medley.runtime.torch_adapter import rerunnable_selective_contexts
from medley.spec.adapter import LoraSpec
from medley.spec.model import ModelSpec


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies (float64, [head_dim / 2]) of the rotary embedding, scaled as the spec says
    (``linear``: divided by the factor; ``llama3``: Llama 3.1's low/high-frequency interpolation)."""
    dim = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if spec.rope_scaling == "linear":
        return inv_freq / spec.rope_factor
    if spec.rope_scaling == "llama3":
        low, high = spec.rope_low_freq_factor, spec.rope_high_freq_factor
        old_len = spec.rope_original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / spec.rope_factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / spec.rope_factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(seq_len: int, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim / 2] for rotary position embeddings."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), rope_inv_freq(spec))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x: [batch, heads, seq, head_dim] (cos and sin
    [seq, head_dim / 2], or [batch, 1, seq, head_dim / 2] for positions of their own per row)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass(frozen=True, kw_only=True)
class Segments:
    """Packed sequences (:mod:`medley.data.packing`): what attention and positions need of them.

    Attributes:
        positions: [batch, seq] each position counted from its example's start.
        mask: [batch, 1, seq, seq] True where query i may attend key j: j <= i in the same example
            (and inside the sliding window).
    """

    positions: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, segments: torch.Tensor, spec: ModelSpec) -> Segments:
        """From [batch, seq] example indices (non-decreasing along a row)."""
        seq = segments.shape[1]
        index = torch.arange(seq, device=segments.device)
        starts = torch.zeros_like(segments)
        starts[:, 1:] = torch.where(segments[:, 1:] != segments[:, :-1], index[1:], 0)
        positions = index - starts.cummax(dim=1).values
        distance = index[:, None] - index[None, :]
        allowed = distance >= 0
        if spec.sliding_window is not None:
            allowed = allowed & (distance < spec.sliding_window)
        same = segments[:, :, None] == segments[:, None, :]
        return cls(positions=positions, mask=(same & allowed)[:, None])


class Attention(nn.Module):
    """Causal grouped-query attention (num_kv_heads <= num_heads). With a sliding window W, query i
    attends to keys j with i - W < j <= i (W tokens, itself included: transformers' Mistral/Qwen2
    mask); a sequence no longer than W takes the plain causal kernel, the same maths. Packed
    sequences (``segments``) attend inside each example only, their positions counted from its
    start."""

    def __init__(self, spec: ModelSpec, adapter: LoraSpec | None = None) -> None:
        super().__init__()
        self.spec = spec
        h, q, kv, qkv_bias = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.bias or spec.qkv_bias
        self.wq = linear(h, q, bias=qkv_bias, name="wq", adapter=adapter)
        self.wk = linear(h, kv, bias=qkv_bias, name="wk", adapter=adapter)
        self.wv = linear(h, kv, bias=qkv_bias, name="wv", adapter=adapter)
        self.wo = linear(q, h, bias=spec.bias, name="wo", adapter=adapter)

    def forward(self, x: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        spec = self.spec
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism (medley.runtime.tensor_parallel) q/k/v hold this TP
        # rank's heads only (num_heads / tp, num_kv_heads / tp).
        q = self.wq(x).view(batch, seq, -1, spec.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, spec.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, spec.head_dim).transpose(1, 2)
        if spec.position == "rope":
            cos, sin = rope_tables(seq, spec)
            cos, sin = cos.to(q.device, q.dtype), sin.to(q.device, q.dtype)
            if segments is not None:
                cos, sin = cos[segments.positions][:, None], sin[segments.positions][:, None]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if spec.num_kv_heads != spec.num_heads:
            repeat = spec.num_heads // spec.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        window = spec.sliding_window
        if segments is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.mask)
        elif window is None or seq <= window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.window_mask(seq, window, x.device))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


    @staticmethod
    def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
        """[seq, seq] boolean mask, True where query i may attend key j: j <= i and i - j < window."""
        pos = torch.arange(seq, device=device)
        distance = pos[:, None] - pos[None, :]
        return (distance >= 0) & (distance < window)


class MLP(nn.Module):
    """SwiGLU (gate, up, down) or GELU (up, down)."""

    def __init__(self, spec: ModelSpec, adapter: LoraSpec | None = None) -> None:
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        h, f = spec.hidden_size, spec.ffn_hidden_size
        if self.swiglu:
            self.gate = linear(h, f, bias=spec.bias, name="gate", adapter=adapter)
        self.up = linear(h, f, bias=spec.bias, name="up", adapter=adapter)
        self.down = linear(f, h, bias=spec.bias, name="down", adapter=adapter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block (its linear layers LoRA-adapted where ``adapter`` says)."""

    def __init__(self, spec: ModelSpec, adapter: LoraSpec | None = None) -> None:
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec, adapter)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec, adapter)

    def forward(self, x: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), segments)
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos = nn.Embedding(spec.max_seq_len, spec.hidden_size) if spec.position == "learned" else None

    def forward(self, tokens: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device) if segments is None \
                else segments.positions
            x = x + self.pos(positions)
        return x


TIED_WEIGHT = "embed.tok.weight"
TIED_COPY = "head.out.weight"


def shared_name(spec: ModelSpec, name: str) -> str:
    """The plan-independent name of parameter ``name``: with tied embeddings, the LM head's copy of
    the embedding (on a stage without the embedding) is the embedding's weight."""
    return TIED_WEIGHT if spec.tied_embeddings and name == TIED_COPY else name


class Head(nn.Module):
    """Final norm and LM head. With tied embeddings the projection borrows the embedding's weight
    when the stage holds the embedding; ``tied_copy`` (a pipeline's last stage without it) keeps
    its own copy of that weight instead, which the runtime keeps equal (Megatron-LM's scheme)."""

    def __init__(self, spec: ModelSpec, *, tied_copy: bool = False) -> None:
        super().__init__()
        self.norm = _norm(spec)
        owns = tied_copy or not spec.tied_embeddings
        self.out = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if owns else None

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None) -> torch.Tensor:
        x = self.norm(x)
        return F.linear(x, tied_weight) if self.out is None else self.out(x)


def init_values(named_shapes: Iterable[tuple[str, Sequence[int]]], seed: int, layer_index: int,
                num_blocks: int) -> Iterator[tuple[str, float | torch.Tensor]]:
    """The seeded initial value of each parameter of one layer, given by (name, full shape): a float
    where every element takes it (unit norms, zero biases), else the whole drawn tensor: N(0, 0.02)
    matrices, residual outputs scaled by depth. Parameters are drawn in name order from a generator
    private to the layer, lazily (one whole tensor at a time), so a sharded stage can keep its
    slice of each (:mod:`medley.runtime.materialize`) and get the values of the whole layer.
    LoRA adapters (:func:`medley.runtime.lora.adapter_init`) draw from a generator of their own,
    after the base, so that an adapted model's base is the plain model's."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_index)
    named_shapes = sorted(named_shapes, key=lambda item: item[0])
    for name, shape in named_shapes:
        if is_adapter_name(name):
            continue
        if "norm" in name:
            yield name, 1.0 if name.endswith("weight") else 0.0
        elif name.endswith("bias"):
            yield name, 0.0
        else:
            residual_out = name.endswith(("wo.weight", "down.weight"))
            std = 0.02 / math.sqrt(2 * num_blocks) if residual_out else 0.02
            yield name, torch.randn(tuple(shape), generator=gen, device="cpu") * std  # on a GPU too
    adapter_gen = torch.Generator().manual_seed(seed * 1_000_003 + layer_index + 500_009)
    for name, shape in named_shapes:
        if is_adapter_name(name):
            yield name, adapter_init(name, tuple(shape), adapter_gen)


def init_layer(module: nn.Module, seed: int, layer_index: int, num_blocks: int) -> None:
    """Seeded init of one whole (unsharded) layer in place (:func:`init_values`)."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in init_values(((n, p.shape) for n, p in params.items()), seed, layer_index,
                                       num_blocks):
            params[name].fill_(value) if isinstance(value, float) else params[name].copy_(value)


def tied_copy_value(spec: ModelSpec, seed: int) -> torch.Tensor:
    """The initial value of a tied head's copy (:data:`TIED_COPY`): the embedding's weight, drawn as
    layer 0 draws it."""
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in Embedding(spec).named_parameters()]
    for name, value in init_values(shapes, seed, 0, spec.num_blocks):
        if name == "tok.weight":
            assert isinstance(value, torch.Tensor)
            return value
    raise AssertionError("the embedding has no tok.weight")


def _saved_ops() -> frozenset[Any]:
    """:data:`medley.cost.recompute.SAVED_OPS` as this torch's OpOverloads (those it has)."""
    found = set()
    for name in SAVED_OPS:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


SELECTIVE_SAVED = _saved_ops()


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the matmuls' and the attention kernel's outputs; recompute the rest."""
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """torch's selective checkpoint contexts under medley's policy (:mod:`medley.cost.recompute`),
    their cache kept across reruns (a split backward reruns a block twice:
    :func:`medley.runtime.torch_adapter.rerunnable_selective_contexts`)."""
    return rerunnable_selective_contexts(_selective_policy)


class Decoder(nn.Module):
    """Layers ``[first_layer, last_layer)`` of the model described by ``spec``; ``recompute`` (a
    :class:`medley.cost.recompute.Recompute`; True: full) says which blocks recompute in the
    backward and how: ``full`` keeps only the block's input, ``selective`` its input and its
    matmuls' and attention's outputs (torch's selective checkpoint contexts); ``init`` False
    leaves the parameters as constructed (for weights loaded next, or shapes on the meta device).

    The input is token ids [batch, seq] when the range holds the embedding, else hidden states
    [batch, seq, hidden]; the output is logits [batch, seq, vocab] when it holds the head, else
    hidden states. ``segments`` ([batch, seq] example indices of packed sequences, the same on
    every stage) makes each example attend to itself only, its positions counted from its start.
    ``adapter``: LoRA adapters on the blocks' linear layers (:mod:`medley.runtime.lora`); the
    caller freezes the base (:func:`~medley.runtime.lora.freeze_base`) once its layers are placed.
    """

    def __init__(self, spec: ModelSpec, *, first_layer: int = 0, last_layer: int | None = None,
                 seed: int = 0, recompute: Recompute | bool = False, init: bool = True,
                 adapter: LoraSpec | None = None) -> None:
        super().__init__()
        last_layer = spec.num_layers if last_layer is None else last_layer
        if not 0 <= first_layer < last_layer <= spec.num_layers:
            raise ValueError(f"layer range [{first_layer}, {last_layer}) is not inside 0..{spec.num_layers}")
        if spec.word_embed_proj_dim is not None:
            raise ValueError(f"model '{spec.name}': a projected word embedding (word_embed_proj_dim) is not "
                             "supported by the runtime")
        has_embed, has_head = first_layer == 0, last_layer == spec.num_layers
        tied_copy = spec.tied_embeddings and has_head and not has_embed
        self.spec = spec
        self.adapter = adapter
        self.recompute = parse_recompute(recompute)
        self.first_layer, self.last_layer = first_layer, last_layer
        self.embed = Embedding(spec) if has_embed else None
        block_ids = range(max(first_layer, 1), min(last_layer, spec.num_blocks + 1))
        self.blocks = nn.ModuleDict({str(i - 1): Block(spec, adapter) for i in block_ids})
        self.head = Head(spec, tied_copy=tied_copy) if has_head else None
        for index, layer in self.layer_modules().items():
            if init:
                init_layer(layer, seed, index, spec.num_blocks)
        if init and tied_copy:
            self._init_tied_copy(seed)

    def _init_tied_copy(self, seed: int) -> None:
        """The head's copy starts as the embedding's weight (drawn as layer 0 draws it)."""
        with torch.no_grad():
            self.head.out.weight.copy_(tied_copy_value(self.spec, seed))

    def layer_modules(self) -> dict[int, nn.Module]:
        """This range's layers by global layer index."""
        layers: dict[int, nn.Module] = {}
        if self.embed is not None:
            layers[0] = self.embed
        for key, block in self.blocks.items():
            layers[int(key) + 1] = block
        if self.head is not None:
            layers[self.spec.num_layers - 1] = self.head
        return layers

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        packed = None if segments is None else Segments.of(segments, self.spec)
        if self.embed is not None:
            x = self.embed(x, packed)
        for position, block in enumerate(self.blocks.values()):
            mode = self.recompute.mode_of(position) if torch.is_grad_enabled() else "none"
            if mode == "full":
                # Keep only the block's input; its activations are recomputed in the backward.
                x = checkpoint(block, x, packed, use_reentrant=False)
            elif mode == "selective":
                x = checkpoint(block, x, packed, use_reentrant=False, context_fn=selective_contexts)
            else:
                x = block(x, packed)
        if self.head is not None:
            tied = self.embed.tok.weight if self.head.out is None else None
            x = self.head(x, tied)
        return x


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (a target of -100 counts nothing); callers divide it by the
    global batch's learned targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
