"""Issue 26, finding 7: a Hugging Face config.json is read as transformers reads it for its
``model_type``, or refused in one line naming config.json, the field and the fix. Each case edits
a saved tiny model's config.json; medley then either refuses it or computes transformers' logits
(fp32, 48 tokens: longer than the windows and RoPE lengths in play) from the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import hf_logits

from medley.errors import MedleyInputError
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.transformer import Decoder
from medley.spec.model_arg import get_model

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# (family, config.json edits, None: logits equal transformers' | the field a refusal names)
CASES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    # The probe's cases: LLaMA has no sliding window in transformers (medley once windowed it and
    # exported a Mistral); a set rope_scaling wins over rope_parameters (medley once ran plain RoPE).
    "llama-sliding-window": ("llama", {"sliding_window": 16}, None),
    "yarn-rope-scaling-beside-default-parameters": (
        "llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": DEFAULT_ROPE},
        "rope_scaling"),
    "linear-rope-scaling-beside-default-parameters": (
        "llama", {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": DEFAULT_ROPE}, None),
    "mistral-ignores-biases": ("mistral", {"attention_bias": True, "mlp_bias": True}, None),
    "qwen2-ignores-biases": ("qwen2", {"attention_bias": True, "mlp_bias": True}, None),
    # Mistral's class warns about layer_types but its masks follow them (medley once ignored them).
    "mistral-layer-types-without-window": (
        "mistral_w8", {"layer_types": ["full_attention", "full_attention"]}, None),
    "mistral-layer-types-half-windowed": (
        "mistral_w8", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    "llama-layer-types-and-window": (
        "llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "sliding_attention"]}, None),
    "attention-dropout": ("llama", {"attention_dropout": 0.1}, "attention_dropout"),
    "partial-rotary-linear": (
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor"),
    "partial-rotary-ignored-by-default-rope": ("llama", {"partial_rotary_factor": 0.5}, None),
    "llama3-original-length-at-top-level": ("llama31", {"original_max_position_embeddings": 32}, None),
    "per-layer-type-rope": (
        "qwen2", {"rope_parameters": {"full_attention": DEFAULT_ROPE}}, "rope_parameters"),
}


def _edited(source: Path, target: Path, edits: dict[str, Any]) -> Path:
    shutil.copytree(source, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(edits)
    (target / "config.json").write_text(json.dumps(cfg))
    return target


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_fields_read_as_transformers_does_or_refused(hf_models, tmp_path: Path, case: str) -> None:
    family, edits, refused = CASES[case]
    directory = _edited(hf_models[family], tmp_path / "model", edits)
    if refused is not None:
        with pytest.raises(MedleyInputError) as info:
            get_model(str(directory))
        message = str(info.value)
        assert "\n" not in message and f"{directory / 'config.json'}: field '{refused}'" in message, message
        return
    spec = get_model(str(directory))
    model = Decoder(spec, init=False)
    load_hf_weights(model, directory)
    tokens = torch.randint(0, spec.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    assert (ours - hf_logits(directory, tokens)).abs().max().item() <= 1e-5


def test_a_llama_with_a_sliding_window_exports_as_a_llama(hf_models, tmp_path: Path) -> None:
    """The window medley once read made the export a Mistral."""
    from medley.spec.hf_config import hf_dict_from_spec

    spec = get_model(str(_edited(hf_models["llama"], tmp_path / "model", {"sliding_window": 16})))
    assert spec.sliding_window is None and hf_dict_from_spec(spec)["model_type"] == "llama"
