"""Tiny random Hugging Face models (one per family medley reads) and transformers' logits of a
saved one: what the Hugging Face tests compare medley against."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128)


def hf_configs() -> dict[str, object]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    llama31_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {
        "llama": LlamaConfig(**{**SHAPE, "vocab_size": 257}),  # odd: ZeRO-3 shards of 129 and 128 rows
        "llama31": LlamaConfig(**SHAPE, rope_parameters=llama31_rope),
        "qwen2": Qwen2Config(**SHAPE, tie_word_embeddings=True),
        "mistral": MistralConfig(**{**SHAPE, "num_hidden_layers": 3}, sliding_window=64, head_dim=24,
                                 rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 10000.0}),
    }


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases and norms too, so that each one matters)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(noise + (1.0 if "norm" in name else 0.0))


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits for ``tokens`` [batch, seq] from a saved model directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
