"""Tiny random Hugging Face models (one per family medley reads, two with a sliding window),
transformers' logits and loss of a saved one (what the Hugging Face tests compare medley
against), and an inline fp32 plan of a model directory."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

SEQ_LEN, MICRO_BATCH_SIZE = 32, 2
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
        # Windows shorter than the tests' sequences (32, 48): every block masks keys 8+ tokens back.
        "mistral_w8": MistralConfig(**SHAPE, sliding_window=8),
        "qwen2_w8": Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=0),
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


def transformers_loss(directory: Path, tokens: torch.Tensor) -> float:
    """transformers' mean next-token loss of ``tokens`` [batch, seq + 1]."""
    logits = hf_logits(directory, tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()


def hf_plan(directory: Path, *, pp: int, dp: int, split: str, zero: str, micro_batches: str) -> Plan:
    """A 1F1B fp32 plan of the directory's model on pp x dp A100s (SEQ_LEN, MICRO_BATCH_SIZE)."""
    cluster = parse_cluster_arg(f"{pp * dp}xA100-80GB")
    model = get_model(str(directory))
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=pp, dp=dp,
        schedule="1f1b", micro_batches=micro_batches, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN,
        split=split, zero=zero, dtype="fp32")
    return Plan(layout=layout, cluster=cluster)
