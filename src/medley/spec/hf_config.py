"""Map a Hugging Face ``config.json`` onto :class:`ModelSpec` (no download, no transformers import)."""

from __future__ import annotations

from typing import Any

from medley.errors import MedleyInputError
from medley.spec.model import ModelSpec

# model_type -> HF key for each ModelSpec size field (first key present wins).
_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {
        "hidden_size": ("n_embd",),
        "num_blocks": ("n_layer",),
        "num_heads": ("n_head",),
        "ffn_hidden_size": ("n_inner",),
        "max_seq_len": ("n_positions",),
    },
    "opt": {
        "hidden_size": ("hidden_size",),
        "num_blocks": ("num_hidden_layers",),
        "num_heads": ("num_attention_heads",),
        "ffn_hidden_size": ("ffn_dim",),
        "max_seq_len": ("max_position_embeddings",),
    },
    "gpt_neo": {
        "hidden_size": ("hidden_size",),
        "num_blocks": ("num_layers",),
        "num_heads": ("num_heads",),
        "ffn_hidden_size": ("intermediate_size",),
        "max_seq_len": ("max_position_embeddings",),
    },
    "llama": {
        "hidden_size": ("hidden_size",),
        "num_blocks": ("num_hidden_layers",),
        "num_heads": ("num_attention_heads",),
        "ffn_hidden_size": ("intermediate_size",),
        "max_seq_len": ("max_position_embeddings",),
    },
}
_GPT_STYLE = {"gpt2", "opt", "gpt_neo"}


def _get(cfg: dict[str, Any], keys: tuple[str, ...], field: str, source: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise MedleyInputError(
        f"{source}: field '{keys[0]}' is missing; medley needs it for {field}. Add it to the config."
    )


def _int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MedleyInputError(f"{source}: field '{key}' must be an integer, got {value!r}.")
    return value


def spec_from_hf_dict(cfg: dict[str, Any], *, source: str) -> ModelSpec:
    """Build a spec from config fields. Unknown model types are read with LLaMA's key names."""
    model_type = str(cfg.get("model_type", "llama"))
    family = model_type if model_type in _KEYS else "llama"
    gpt_style = family in _GPT_STYLE
    keys = _KEYS[family]
    size: dict[str, int] = {}
    for field in ("hidden_size", "num_blocks", "num_heads", "max_seq_len"):
        size[field] = _int(_get(cfg, keys[field], field, source), keys[field][0], source)
    ffn = cfg.get(keys["ffn_hidden_size"][0])
    size["ffn_hidden_size"] = 4 * size["hidden_size"] if ffn is None else _int(ffn, "ffn", source)
    size["vocab_size"] = _int(_get(cfg, ("vocab_size",), "vocab_size", source), "vocab_size", source)
    kv = cfg.get("num_key_value_heads")
    size["num_kv_heads"] = size["num_heads"] if kv is None else _int(kv, "num_key_value_heads", source)
    act = str(cfg.get("hidden_act", cfg.get("activation_function", "gelu")))
    proj = cfg.get("word_embed_proj_dim") if family == "opt" else None
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or model_type),
        mlp="gelu" if gpt_style or act not in ("silu", "swish") else "swiglu",
        norm="layernorm" if gpt_style else "rmsnorm",
        position="learned" if gpt_style else "rope",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", gpt_style)),
        bias=gpt_style or bool(cfg.get("attention_bias", False)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-5))),
        word_embed_proj_dim=None
        if proj in (None, size["hidden_size"])
        else _int(proj, "word_embed_proj_dim", source),
        **size,
    )
