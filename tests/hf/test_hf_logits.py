"""Models read from Hugging Face directories compute what transformers computes (fp32, pp 1), and
the cost model counts their parameters as transformers does."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_logits

from medley.cost.formulas import total_params
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.transformer import Decoder
from medley.spec.model_arg import get_model

FAMILIES = ("llama", "llama31", "qwen2", "mistral")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(hf_models, family: str) -> None:
    directory = hf_models[family]
    spec = get_model(str(directory))
    model = Decoder(spec, init=False)
    load_hf_weights(model, directory)
    tokens = torch.randint(0, spec.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    assert (ours - hf_logits(directory, tokens)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_count_equals_transformers(hf_models, family: str) -> None:
    from transformers import AutoModelForCausalLM

    directory = hf_models[family]
    reference = AutoModelForCausalLM.from_pretrained(directory)
    spec = get_model(str(directory))
    assert total_params(spec) == sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in Decoder(spec, init=False).parameters()) == total_params(spec)


def test_the_families_fields_are_read(hf_models) -> None:
    qwen, llama31, mistral = (get_model(str(hf_models[f])) for f in ("qwen2", "llama31", "mistral"))
    assert qwen.qkv_bias and not qwen.bias and qwen.tied_embeddings
    assert (llama31.rope_scaling, llama31.rope_factor) == ("llama3", 8.0)
    assert (llama31.rope_original_max_seq_len, llama31.rope_theta) == (16, 500000.0)
    assert (mistral.explicit_head_dim, mistral.q_dim, mistral.sliding_window) == (24, 96, 64)
    assert mistral.rope_scaling == "linear"
