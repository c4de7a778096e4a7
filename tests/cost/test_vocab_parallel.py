"""The LM head and its cross-entropy split over the vocabulary under TP (Megatron-LM's
vocabulary-parallel head), for a cost source made ``vocab_parallel``; replicated otherwise, as
medley's runtime runs it."""

from __future__ import annotations

import pytest

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Pass
from medley.cost.tp_cost import TensorParallelCompute
from medley.spec.model_arg import get_model

MODEL = get_model("llama-2-7b")
AT = {"micro_batch_size": 4, "seq_len": 2048, "device_type": "A100-80GB"}


def test_each_rank_multiplies_its_slice_of_the_vocabulary() -> None:
    head = MODEL.num_layers - 1
    whole = formulas.layer_gemms(MODEL, head, micro_batch_size=1, seq_len=8, tp=8)
    split = formulas.layer_gemms(MODEL, head, micro_batch_size=1, seq_len=8, tp=8, vocab_parallel=True)
    assert whole[-1].out_features == MODEL.vocab_size
    assert split[-1].out_features == -(-MODEL.vocab_size // 8)
    loss = formulas.layer_elementwise_bytes(MODEL, head, Pass.F, micro_batch_size=1, seq_len=8, tp=8)[0]
    cut = formulas.layer_elementwise_bytes(MODEL, head, Pass.F, micro_batch_size=1, seq_len=8, tp=8,
                                           vocab_parallel=True)[0]
    assert cut < loss / 4  # the logits' cross-entropy dominates the head's traffic


@pytest.mark.parametrize("kind", list(Pass))
def test_the_head_of_a_tp_stage_is_split_only_when_the_source_says_so(kind: Pass) -> None:
    head = MODEL.num_layers - 1
    replicated = CatalogCostSource(MODEL)
    megatron = CatalogCostSource(MODEL, vocab_parallel=True)
    alone = replicated.layer_time(head, kind, **AT).seconds
    same = TensorParallelCompute(MODEL, replicated, catalog=replicated).layer_time(head, kind, tp=4, **AT)
    split = TensorParallelCompute(MODEL, megatron, catalog=megatron).layer_time(head, kind, tp=4, **AT)
    assert same == alone
    assert alone / 4 <= split < alone / 2.5  # smaller matmuls reach less of the peak
    one = TensorParallelCompute(MODEL, megatron, catalog=megatron).layer_time(head, kind, tp=1, **AT)
    assert one == alone  # tp 1: nothing to split
