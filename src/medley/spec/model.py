"""Decoder-only transformer specs: presets and import from a local Hugging Face ``config.json``.

A model is a list of layers: index 0 the embedding, 1..num_blocks the transformer blocks, and the
last one the final norm + LM head + loss. Pipeline stages own contiguous ranges of these layers.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, create_model

from medley.errors import MedleyInputError
from medley.spec.cluster_schema import STRICT, describe_validation_error, printable
from medley.spec.limits import MAX_BLOCKS, MAX_SIZE

LayerKind = Literal["embedding", "block", "head"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    index: int
    kind: LayerKind


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    Attributes:
        name: preset name or the config file's model name.
        vocab_size: rows of the token embedding.
        hidden_size: model width h.
        num_blocks: transformer blocks.
        num_heads: attention (query) heads; head_dim = hidden_size / num_heads unless
            ``explicit_head_dim`` is set.
        num_kv_heads: key/value heads (< num_heads for GQA, == for MHA).
        ffn_hidden_size: MLP inner width (per branch for SwiGLU).
        mlp: ``swiglu`` (3 matrices) or ``gelu`` (2 matrices; also used for OPT's ReLU).
        norm: ``rmsnorm`` (weight only) or ``layernorm`` (weight and bias).
        position: ``rope`` or ``learned`` absolute position embeddings.
        max_seq_len: longest sequence (size of a learned position table).
        tied_embeddings: LM head shares the token embedding's weight.
        bias: linear layers carry biases (GPT-2/3, OPT, GPT-Neo).
        qkv_bias: the Q, K and V projections carry biases even when ``bias`` is false (Qwen2).
        rope_theta: RoPE base.
        norm_eps: norm epsilon.
        word_embed_proj_dim: OPT-350M style narrower token embedding projected to hidden_size
            (None: the embedding is hidden_size wide).
        explicit_head_dim: width of one attention head when it is not hidden_size / num_heads
            (a config's ``head_dim``); None: hidden_size / num_heads.
        rope_scaling: ``none``, ``linear`` (positions divided by ``rope_factor``) or ``llama3``
            (Llama 3.1's frequency-dependent scaling, with the three fields below).
        rope_factor: the scaling factor (``linear`` and ``llama3``).
        rope_low_freq_factor: ``llama3``'s low_freq_factor.
        rope_high_freq_factor: ``llama3``'s high_freq_factor.
        rope_original_max_seq_len: ``llama3``'s original_max_position_embeddings.
        sliding_window: each token attends to at most this many tokens (itself included); None:
            full causal attention. Query i attends to keys i - window < j <= i (Mistral's mask).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    mlp: Literal["swiglu", "gelu"]
    norm: Literal["rmsnorm", "layernorm"]
    position: Literal["rope", "learned"]
    max_seq_len: int
    tied_embeddings: bool
    bias: bool
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    word_embed_proj_dim: int | None = None
    qkv_bias: bool = False
    explicit_head_dim: int | None = None
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        sizes = (
            "vocab_size",
            "hidden_size",
            "num_blocks",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "max_seq_len",
        )
        for field_name in sizes:
            limit = MAX_BLOCKS if field_name == "num_blocks" else MAX_SIZE
            if not 0 < getattr(self, field_name) <= limit:
                raise MedleyInputError(
                    f"model '{printable(self.name)}': field '{field_name}' must be an integer in "
                    f"1..{limit:,}, got {getattr(self, field_name)}."
                )
        if self.word_embed_proj_dim is not None and not 0 < self.word_embed_proj_dim <= MAX_SIZE:
            raise MedleyInputError(
                f"model '{printable(self.name)}': field 'word_embed_proj_dim' must be an integer in "
                f"1..{MAX_SIZE:,} (or absent), got {self.word_embed_proj_dim}."
            )
        if not (0 < self.rope_theta < float("inf") and 0 < self.norm_eps < 1):
            raise MedleyInputError(
                f"model '{printable(self.name)}': rope_theta must be a positive number and norm_eps "
                f"in (0, 1), got {self.rope_theta} and {self.norm_eps}."
            )
        self._check_attention_fields()
        if self.num_heads % self.num_kv_heads:
            raise MedleyInputError(
                f"model '{printable(self.name)}': num_heads {self.num_heads} must be a multiple "
                f"of num_kv_heads {self.num_kv_heads}."
            )

    def _check_attention_fields(self) -> None:
        for field_name in ("explicit_head_dim", "sliding_window"):
            value = getattr(self, field_name)
            if value is not None and not 0 < value <= MAX_SIZE:
                raise MedleyInputError(
                    f"model '{printable(self.name)}': field '{field_name}' must be an integer in "
                    f"1..{MAX_SIZE:,} (or absent), got {value}."
                )
        if not (0 < self.rope_factor < float("inf") and 0 < self.rope_low_freq_factor
                < self.rope_high_freq_factor < float("inf") and self.rope_original_max_seq_len > 0):
            raise MedleyInputError(
                f"model '{printable(self.name)}': rope_factor must be positive, 0 < rope_low_freq_factor "
                f"< rope_high_freq_factor and rope_original_max_seq_len positive, got {self.rope_factor}, "
                f"{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, "
                f"{self.rope_original_max_seq_len}."
            )
        if self.explicit_head_dim is None and self.hidden_size % self.num_heads:
            raise MedleyInputError(
                f"model '{printable(self.name)}': hidden_size {self.hidden_size} must be divisible "
                f"by num_heads {self.num_heads} (or set explicit_head_dim)."
            )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the Q projection's output (and the attention output projection's input)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection's output."""
        return self.num_kv_heads * self.head_dim

    @property
    def embed_dim(self) -> int:
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def num_layers(self) -> int:
        return self.num_blocks + 2

    def layer_kind(self, index: int) -> LayerKind:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range for {self.name} ({self.num_layers} layers)")
        if index == 0:
            return "embedding"
        return "head" if index == self.num_layers - 1 else "block"

    def layers(self) -> list[Layer]:
        return [Layer(index=i, kind=self.layer_kind(i)) for i in range(self.num_layers)]

    def check_seq_len(self, seq_len: int, *, field: str = "--seq-len") -> None:
        """Refuse sequences longer than the model's longest (``max_seq_len``): a plan of them cannot
        be trained, so ``medley plan``, ``simulate``, ``show``, ``train`` and ``model show`` all refuse
        them here (``field`` names the flag or plan field)."""
        if seq_len > self.max_seq_len:
            raise MedleyInputError(
                f"{field} {seq_len}: longer than the longest sequence of model '{printable(self.name)}', "
                f"{self.max_seq_len} (max_seq_len); use --seq-len {self.max_seq_len} or less")

    def default_seq_len(self, usual: int = 2048) -> int:
        """The tokens per sequence when none is given: ``usual``, or the model's longest if shorter."""
        return min(usual, self.max_seq_len)


def _llama(
    name: str, vocab: int, h: int, blocks: int, heads: int, kv: int, ffn: int, seq: int, theta: float
) -> ModelSpec:
    return ModelSpec(
        name=name,
        vocab_size=vocab,
        hidden_size=h,
        num_blocks=blocks,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        mlp="swiglu",
        norm="rmsnorm",
        position="rope",
        max_seq_len=seq,
        tied_embeddings=False,
        bias=False,
        rope_theta=theta,
        norm_eps=1e-5,
    )


def _gpt(
    name: str, vocab: int, h: int, blocks: int, heads: int, seq: int, proj: int | None = None
) -> ModelSpec:
    return ModelSpec(
        name=name,
        vocab_size=vocab,
        hidden_size=h,
        num_blocks=blocks,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=4 * h,
        mlp="gelu",
        norm="layernorm",
        position="learned",
        max_seq_len=seq,
        tied_embeddings=True,
        bias=True,
        word_embed_proj_dim=proj,
    )


# GPT-Neo alternates global and local (window 256) attention; the cost model treats every layer
# as full attention, which overstates its attention-score FLOPs at long sequences.
# OPT uses ReLU; it costs the same as GELU here.
PRESETS: dict[str, ModelSpec] = {
    "tiny": _llama("tiny", 256, 64, 4, 4, 2, 176, 128, 10000.0),
    "opt-350m": _gpt("opt-350m", 50272, 1024, 24, 16, 2048, proj=512),
    "gpt-neo-2.7b": _gpt("gpt-neo-2.7b", 50257, 2560, 32, 20, 2048),
    "llama-2-7b": _llama("llama-2-7b", 32000, 4096, 32, 32, 32, 11008, 4096, 10000.0),
    "llama-2-13b": _llama("llama-2-13b", 32000, 5120, 40, 40, 40, 13824, 4096, 10000.0),
    "llama-2-70b": _llama("llama-2-70b", 32000, 8192, 80, 64, 8, 28672, 4096, 10000.0),
    "llama-3-8b": _llama("llama-3-8b", 128256, 4096, 32, 32, 8, 14336, 8192, 500000.0),
    "llama-3-70b": _llama("llama-3-70b", 128256, 8192, 80, 64, 8, 28672, 8192, 500000.0),
    "gpt-3-175b": _gpt("gpt-3-175b", 50257, 12288, 96, 96, 2048),
}


@functools.cache
def _model_fields() -> type[BaseModel]:
    """A strict pydantic schema with ModelSpec's fields (types and defaults), for model tables in files."""
    hints = typing.get_type_hints(ModelSpec)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(ModelSpec)
    }
    return create_model("ModelFields", __config__=STRICT, **fields)


def model_from_dict(raw: Any, *, source: str, doc: str) -> ModelSpec:
    """A model from a file's table of ModelSpec fields (``source`` names the table, ``doc`` where its
    format is described); strictly typed, every problem a one-line :class:`MedleyInputError`."""
    try:
        fields = _model_fields().model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, source, doc=doc)) from None
    try:
        model = ModelSpec(**fields.model_dump())
    except MedleyInputError as err:
        raise MedleyInputError(f"{source}: {err}") from None
    preset = PRESETS.get(model.name.lower())
    differ = [] if preset is None else [
        f"{f.name} = {getattr(model, f.name)!r} (the preset's: {getattr(preset, f.name)!r})"
        for f in dataclasses.fields(ModelSpec)
        if f.name != "name" and getattr(model, f.name) != getattr(preset, f.name)]
    if differ:  # it would be shown and titled as the preset
        raise MedleyInputError(printable(
            f"{source}: field 'name' = {model.name!r} is a preset, but {'; '.join(differ[:3])}"
            f"{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}; give the model a name of "
            "its own, or leave out the fields that differ to use the preset"))
    return model
