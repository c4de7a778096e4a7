"""Map a Hugging Face ``config.json`` onto :class:`ModelSpec` (no download, no transformers import).

Only the families medley models are read: LLaMA (2, 3, 3.1, 3.2), Mistral and Qwen2 (rotary
positions, possibly scaled (``linear``, ``llama3``), RMSNorm, a gated SiLU MLP, Qwen2's Q/K/V
biases, an explicit ``head_dim``, a sliding window) and GPT-2, OPT and GPT-Neo (learned
positions, LayerNorm, a two-matrix MLP). An unknown ``model_type``, a mixture-of-experts field,
or any field that changes the maths in a way medley does not model is refused, naming the field.
Optional fields take transformers' defaults for the ``model_type`` (LLaMA's ``hidden_act`` is
``silu``, its ``rms_norm_eps`` 1e-6, ...); the shape fields (width, depth, heads, vocabulary,
positions) must be given.

LLaMA-family fields are read as transformers' class for that ``model_type`` reads them (its
``modeling_*.py``), so that weights loaded with ``--init-from`` compute what they compute there:
LLaMA ignores ``sliding_window`` (no window), Mistral's ``layer_types`` can turn its window off,
Mistral and Qwen2 ignore ``attention_bias`` and
``mlp_bias``, a set ``rope_scaling`` wins over ``rope_parameters``; what transformers honours
and medley does not run (attention dropout, YaRN and other RoPE types, partial rotary factors,
per-layer RoPE) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medley.errors import MedleyInputError
from medley.fileio import read_user_json
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec

_LLAMA_KEYS = {
    "hidden_size": ("hidden_size",),
    "num_blocks": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "ffn_hidden_size": ("intermediate_size",),
    "max_seq_len": ("max_position_embeddings",),
}
# model_type -> HF key for each ModelSpec size field.
_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {
        "hidden_size": ("n_embd",),
        "num_blocks": ("n_layer",),
        "num_heads": ("n_head",),
        "ffn_hidden_size": ("n_inner",),
        "max_seq_len": ("n_positions",),
    },
    "opt": {**_LLAMA_KEYS, "ffn_hidden_size": ("ffn_dim",)},
    "gpt_neo": {**_LLAMA_KEYS, "num_blocks": ("num_layers",), "num_heads": ("num_heads",)},
    "llama": _LLAMA_KEYS,
    "mistral": _LLAMA_KEYS,
    "qwen2": _LLAMA_KEYS,
}
_GPT_STYLE = {"gpt2", "opt", "gpt_neo"}
# transformers' defaults (the *Config classes) for the optional fields medley reads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    },
    "mistral": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
    },
    "qwen2": {
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "gpt2": {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
    "opt": {"ffn_dim": 3072, "tie_word_embeddings": True, "layer_norm_epsilon": 1e-5},
    "gpt_neo": {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
}
# Fields that make a model a mixture of experts: medley costs dense models only.
_MOE_KEYS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "moe_num_experts",
    "expert_interval",
)


def _fail(source: str, key: str, problem: str, fix: str) -> MedleyInputError:
    return MedleyInputError(printable(f"{source}: field '{key}': {problem}; {fix}."))


def _get(cfg: dict[str, Any], key: str, field: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise _fail(source, key, f"is missing; medley needs it for {field}", "add it to the config")
    return cfg[key]


def _int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(source, key, f"must be an integer, got {value!r}", "write a whole number")
    return value


def _number(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(source, key, f"must be a number, got {value!r}", "write a number")
    return float(value)


def _model_type(cfg: dict[str, Any], source: str) -> str:
    for key in _MOE_KEYS:
        if cfg.get(key) not in (None, 0, 1):
            raise _fail(source, key, f"= {cfg[key]!r} makes a mixture-of-experts model, which medley does "
                        "not cost", "plan a dense model (MoE support is not implemented)")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in _KEYS:
        problem = "is missing" if model_type is None else f"{model_type!r} is not a family medley reads"
        raise _fail(source, "model_type", problem,
                    f"give one of {', '.join(_KEYS)} (or a preset name)")
    return str(model_type)


def _check_llama_maths(cfg: dict[str, Any], model_type: str, source: str) -> bool:
    """Refuse LLaMA-family fields medley does not model; return whether every linear carries a
    bias. Read as transformers reads them: LLaMA honours ``attention_bias`` and ``mlp_bias``;
    Mistral's and Qwen2's classes ignore both (Mistral has no biases, Qwen2 Q/K/V biases only)."""
    act = cfg["hidden_act"]
    if act not in ("silu", "swish"):
        raise _fail(source, "hidden_act", f"{act!r}: medley's LLaMA-style MLP is SwiGLU", "use silu")
    dropout = cfg.get("attention_dropout") or 0
    if dropout != 0:
        raise _fail(source, "attention_dropout", f"= {dropout!r}: transformers trains with attention "
                    "dropout, medley without", "set it to 0.0")
    if model_type != "llama":
        return False
    attention_bias = bool(cfg.get("attention_bias", False))
    if attention_bias != bool(cfg.get("mlp_bias", False)):
        raise _fail(source, "attention_bias", "differs from mlp_bias; medley gives every linear layer "
                    "a bias or none (Qwen2's Q/K/V biases aside)", "make attention_bias and mlp_bias equal")
    return attention_bias


def _attention_fields(
    cfg: dict[str, Any], model_type: str, size: dict[str, int], source: str,
) -> dict[str, Any]:
    """ModelSpec's head width, sliding window and Q/K/V bias fields of a LLaMA-family config."""
    fields: dict[str, Any] = {"qkv_bias": model_type == "qwen2"}
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        head_dim = _int(head_dim, "head_dim", source)
        if head_dim * size["num_heads"] != size["hidden_size"]:
            fields["explicit_head_dim"] = head_dim
    window = _window(cfg, model_type, size["num_blocks"], source)
    if window is not None and window < size["max_seq_len"]:
        fields["sliding_window"] = window
    return fields


def _window(cfg: dict[str, Any], model_type: str, num_blocks: int, source: str) -> int | None:
    """The sliding window of every block, or None, as transformers reads it: LLaMA has none (its
    class ignores ``sliding_window``); Mistral windows the blocks its ``layer_types`` mark, by
    default all; Qwen2 only with ``use_sliding_window`` and only the blocks its ``layer_types``
    mark, by default those from ``max_window_layers`` on. All or none is modelled, a mix is
    refused."""
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None or (model_type == "qwen2" and not cfg["use_sliding_window"]):
        return None
    window = _int(window, "sliding_window", source)
    types = cfg.get("layer_types")
    if types is None and model_type == "mistral":
        return window
    key = "layer_types" if types is not None else "max_window_layers"
    if types is None:
        first = _int(cfg["max_window_layers"], "max_window_layers", source)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_blocks)]
    if not isinstance(types, list) or not set(types) <= {"sliding_attention", "full_attention"}:
        raise _fail(source, "layer_types", f"must list 'sliding_attention' or 'full_attention' per layer, "
                    f"got {types!r}", "fix or remove the list")
    windowed = types.count("sliding_attention")
    if 0 < windowed < len(types):
        raise _fail(source, key, f"windows {windowed} of {len(types)} layers; medley models a window on "
                    "every layer or none", "set max_window_layers to 0 (and drop layer_types) or "
                    "use_sliding_window to false")
    return window if windowed else None


def _rope_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelSpec's RoPE fields, read as transformers reads them: ``rope_scaling`` (transformers 4's
    field) when it is set, else ``rope_parameters`` (5's); ``rope_theta`` from that object, else
    the top level; ``partial_rotary_factor`` applies to scaled types only (LLaMA's default RoPE
    ignores it) and is refused there; llama3's ``original_max_position_embeddings`` from the top
    level, else the object, else ``max_position_embeddings``."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise _fail(source, key, f"must be an object, got {params!r}", "write a JSON object or null")
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:
        raise _fail(source, key, f"holds RoPE parameters per layer type ({', '.join(nested)}), which medley "
                    "does not model", "give one object of RoPE parameters")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"rope_theta": _number(theta, "rope_theta", source)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return fields
    if rope_type not in ("linear", "llama3"):
        raise _fail(source, key, f"rope_type {printable(str(rope_type))!r} is not modelled",
                    "medley runs default, linear and llama3 RoPE")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise _fail(source, "partial_rotary_factor", f"= {partial!r} rotates part of each head, which medley "
                    "does not model", "remove it or set it to 1.0")
    fields["rope_scaling"] = rope_type
    fields["rope_factor"] = _number(_get(params, "factor", "rope_factor", source), "factor", source)
    if rope_type == "llama3":
        for name, field in (("low_freq_factor", "rope_low_freq_factor"),
                            ("high_freq_factor", "rope_high_freq_factor")):
            fields[field] = _number(_get(params, name, field, source), name, source)
        original = "original_max_position_embeddings"
        value = cfg.get(original, params.get(original, cfg.get("max_position_embeddings")))
        fields["rope_original_max_seq_len"] = _int(value, original, source)
    return fields


def spec_from_hf_dict(cfg: dict[str, Any], *, source: str) -> ModelSpec:
    """Build a spec from config fields (see the module docstring for what is read and refused)."""
    model_type = _model_type(cfg, source)
    cfg = {**_DEFAULTS[model_type], **cfg}  # an explicit null (e.g. sliding_window) stays null
    keys = _KEYS[model_type]
    gpt_style = model_type in _GPT_STYLE
    size: dict[str, int] = {}
    for field in ("hidden_size", "num_blocks", "num_heads", "max_seq_len"):
        size[field] = _int(_get(cfg, keys[field][0], field, source), keys[field][0], source)
    ffn_key = keys["ffn_hidden_size"][0]
    ffn = cfg.get(ffn_key) if gpt_style else _get(cfg, ffn_key, "ffn_hidden_size", source)
    size["ffn_hidden_size"] = 4 * size["hidden_size"] if ffn is None else _int(ffn, ffn_key, source)
    size["vocab_size"] = _int(_get(cfg, "vocab_size", "vocab_size", source), "vocab_size", source)
    kv = cfg.get("num_key_value_heads")
    size["num_kv_heads"] = size["num_heads"] if kv is None else _int(kv, "num_key_value_heads", source)
    bias = True if gpt_style else _check_llama_maths(cfg, model_type, source)
    extra = {} if gpt_style else {**_attention_fields(cfg, model_type, size, source),
                                  **_rope_fields(cfg, source)}
    proj = cfg.get("word_embed_proj_dim") if model_type == "opt" else None
    eps_key = "layer_norm_epsilon" if gpt_style else "rms_norm_eps"
    try:
        return _spec(cfg, model_type, size, bias, proj, eps_key, source, extra)
    except MedleyInputError as err:
        raise MedleyInputError(f"{printable(source)}: {err}") from None


def _spec(
    cfg: dict[str, Any], model_type: str, size: dict[str, int], bias: bool, proj: Any, eps_key: str,
    source: str, extra: dict[str, Any],
) -> ModelSpec:
    gpt_style = model_type in _GPT_STYLE
    return ModelSpec(
        name=printable(cfg.get("_name_or_path") or model_type),
        mlp="gelu" if gpt_style else "swiglu",
        norm="layernorm" if gpt_style else "rmsnorm",
        position="learned" if gpt_style else "rope",
        tied_embeddings=bool(cfg["tie_word_embeddings"]),
        bias=bias,
        **{"rope_theta": _number(cfg.get("rope_theta", 10000.0), "rope_theta", source), **extra},
        norm_eps=_number(cfg[eps_key], eps_key, source),
        word_embed_proj_dim=None
        if proj in (None, size["hidden_size"])
        else _int(proj, "word_embed_proj_dim", source),
        **size,
    )


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default" if spec.rope_scaling == "none" else spec.rope_scaling,
                            "rope_theta": spec.rope_theta}
    if spec.rope_scaling != "none":
        rope["factor"] = spec.rope_factor
    if spec.rope_scaling == "llama3":
        rope.update(low_freq_factor=spec.rope_low_freq_factor, high_freq_factor=spec.rope_high_freq_factor,
                    original_max_position_embeddings=spec.rope_original_max_seq_len)
    return rope


def hf_dict_from_spec(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` fields of a LLaMA-family spec (the inverse of :func:`spec_from_hf_dict`):
    Qwen2 for Q/K/V-only biases, Mistral for a sliding window, else LLaMA; fp32 weights."""
    if spec.qkv_bias and spec.bias:
        raise MedleyInputError(f"model '{spec.name}': qkv_bias with bias has no Hugging Face family")
    model_type = "qwen2" if spec.qkv_bias else "mistral" if spec.sliding_window is not None else "llama"
    rope = _rope_parameters(spec)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size, "num_hidden_layers": spec.num_blocks,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "max_position_embeddings": spec.max_seq_len, "hidden_act": "silu",
        "rms_norm_eps": spec.norm_eps, "tie_word_embeddings": spec.tied_embeddings,
        "rope_parameters": rope, "rope_theta": spec.rope_theta,
        "rope_scaling": None if spec.rope_scaling == "none" else rope, "dtype": "float32",
    }
    if model_type == "llama":
        cfg.update(attention_bias=spec.bias, mlp_bias=spec.bias)
    elif model_type == "mistral":
        cfg["sliding_window"] = spec.sliding_window
    else:
        window = spec.sliding_window is not None
        cfg.update(use_sliding_window=window, sliding_window=spec.sliding_window, max_window_layers=0)
    return cfg


def load_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (LLaMA, Mistral, GPT-2, OPT, GPT-Neo families)."""
    cfg = read_user_json(path, what="model config", fix="fix the syntax")
    if not isinstance(cfg, dict):
        raise MedleyInputError(f"{path}: expected a JSON object of Hugging Face config fields.")
    return spec_from_hf_dict(cfg, source=str(path))
