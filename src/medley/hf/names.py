"""The one map between medley's parameter names and Hugging Face transformers' LLaMA-family names
(LLaMA, Mistral, Qwen2 share them), used by ``--init-from`` and by the export.

=========================================== ==================================================
medley (:mod:`medley.runtime.transformer`)         transformers
=========================================== ==================================================
``embed.tok.weight``                         ``model.embed_tokens.weight``
``blocks.<i>.attn_norm.weight``              ``model.layers.<i>.input_layernorm.weight``
``blocks.<i>.attn.wq|wk|wv|wo.<w or b>``     ``model.layers.<i>.self_attn.q_proj|k_proj|v_proj|o_proj.*``
``blocks.<i>.mlp_norm.weight``               ``model.layers.<i>.post_attention_layernorm.weight``
``blocks.<i>.mlp.gate|up|down.weight``       ``model.layers.<i>.mlp.gate_proj|up_proj|down_proj.weight``
``head.norm.weight``                         ``model.norm.weight``
``head.out.weight``                          ``lm_head.weight`` (absent with tied embeddings)
=========================================== ==================================================

A LoRA adapter's ``blocks.<i>.attn.wq.lora_a|lora_b`` is saved as PEFT saves it
(:func:`peft_name`): ``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A|lora_B.weight``.
"""

from __future__ import annotations

import re

from medley.errors import MedleyInputError
from medley.spec.model import ModelSpec

_FIXED = {
    "embed.tok.weight": "model.embed_tokens.weight",
    "head.norm.weight": "model.norm.weight",
    "head.out.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_ADAPTER_NAME = re.compile(r"blocks\.(\d+)\.(.+)\.lora_(a|b)")


def check_hf_family(spec: ModelSpec, *, what: str) -> None:
    """Refuse a model outside the LLaMA family (RoPE, RMSNorm, SwiGLU), whose names are not mapped."""
    if (spec.position, spec.norm, spec.mlp) != ("rope", "rmsnorm", "swiglu"):
        raise MedleyInputError(
            f"{what}: model '{spec.name}' is not a LLaMA-family model (RoPE, RMSNorm, SwiGLU); Hugging Face "
            "weights are read and written for LLaMA, Mistral and Qwen2 models only")


def hf_name(name: str) -> str:
    """The transformers name of medley parameter ``name``."""
    if name in _FIXED:
        return _FIXED[name]
    match = _BLOCK_NAME.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        raise KeyError(f"medley parameter {name!r} has no Hugging Face name")
    index, module, kind = match.groups()
    return f"model.layers.{index}.{_BLOCK[module]}.{kind}"


def peft_name(name: str) -> str:
    """The name PEFT saves medley adapter parameter ``name`` (``blocks.<i>.<layer>.lora_a|b``) under."""
    match = _ADAPTER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        raise KeyError(f"medley parameter {name!r} is not a LoRA adapter's")
    index, module, which = match.groups()
    return f"base_model.model.model.layers.{index}.{_BLOCK[module]}.lora_{which.upper()}.weight"
