"""Tensor parallelism's cost per block: the all-reduces' volume and time, one rank's compute, and
what a TP rank holds (split matrices and activations, replicated norms, embedding and head)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Pass
from medley.cost.tp_cost import (
    TP_ALL_REDUCES,
    TensorParallelCompute,
    activation_scale,
    tp_all_reduce_bytes,
    tp_comm_time,
)
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

GB = 1e9
CLUSTER = parse_cluster_arg("8xA100-80GB")
LLAMA = get_model("llama-2-7b")


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from((2, 4, 8)), mbs=st.integers(1, 8), seq=st.sampled_from((128, 1024, 4096)),
       dtype=st.sampled_from(("bf16", "fp32")))
def test_block_all_reduces_are_two_ring_all_reduces_of_the_hidden_states_per_pass(
    tp: int, mbs: int, seq: int, dtype: str
) -> None:
    comm = TopologyCommModel(CLUSTER)
    nbytes = mbs * seq * LLAMA.hidden_size * (4 if dtype == "fp32" else 2)
    assert tp_all_reduce_bytes(LLAMA, micro_batch_size=mbs, seq_len=seq, dtype=dtype) == nbytes
    # A ring all-reduce over tp NVLink ports (300 GB/s, 2 us): 2 (t-1) steps, 2 (t-1)/t of the bytes.
    one = 2 * ((tp - 1) * 2e-6 + (tp - 1) / tp * nbytes / (300 * GB))
    group = tuple(range(tp))
    for kind, count in ((Pass.F, 2), (Pass.B, 2), (Pass.W, 0)):
        got = tp_comm_time(comm, LLAMA, 1, kind, group=group, micro_batch_size=mbs, seq_len=seq, dtype=dtype)
        assert got == pytest.approx(count * one)
        assert TP_ALL_REDUCES[kind] == count
    # Replicated layers and a group of one communicate nothing.
    for layer in (0, LLAMA.num_layers - 1):
        assert tp_comm_time(comm, LLAMA, layer, Pass.F, group=group, micro_batch_size=mbs, seq_len=seq,
                            dtype=dtype) == 0.0
    alone = tp_comm_time(comm, LLAMA, 1, Pass.F, group=(0,), micro_batch_size=mbs, seq_len=seq, dtype=dtype)
    assert alone == 0


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from((2, 4, 8)), mbs=st.integers(1, 4), seq=st.sampled_from((64, 512, 4096)),
       kind=st.sampled_from(tuple(Pass)), model=st.sampled_from(("llama-2-7b", "opt-350m", "tiny")))
def test_a_rank_computes_at_least_its_share_and_at_most_the_whole(
    tp: int, mbs: int, seq: int, kind: Pass, model: str
) -> None:
    spec = get_model(model)
    if spec.num_heads % tp or spec.num_kv_heads % tp or spec.ffn_hidden_size % tp:
        return
    cost = CatalogCostSource.for_cluster(spec, CLUSTER)
    tensor = TensorParallelCompute(spec, cost, catalog=cost)
    at = {"micro_batch_size": mbs, "seq_len": seq, "device_type": "A100-80GB"}
    whole = cost.layer_time(1, kind, **at).seconds
    split = tensor.layer_time(1, kind, tp=tp, **at)
    assert whole / tp <= split * (1 + 1e-9) and split <= whole * (1 + 1e-9)
    # The head and embedding are replicated: the same time at any degree.
    last = spec.num_layers - 1
    assert tensor.layer_time(last, kind, tp=tp, **at) == cost.layer_time(last, kind, **at).seconds


def test_small_gemms_lose_efficiency_under_tp() -> None:
    """A small model split 8 ways gains far less than 8x; a 7B block at long sequences nearly 2x
    at tp 2 (large GEMMs stay efficient)."""
    tiny = get_model("opt-350m")
    small = TensorParallelCompute(tiny, CatalogCostSource.for_cluster(tiny, CLUSTER),
                                  catalog=CatalogCostSource.for_cluster(tiny, CLUSTER))
    assert small.scale(Pass.F, micro_batch_size=1, seq_len=128, device_type="A100-80GB", tp=8) > 2 / 8
    big = TensorParallelCompute(LLAMA, CatalogCostSource.for_cluster(LLAMA, CLUSTER),
                                catalog=CatalogCostSource.for_cluster(LLAMA, CLUSTER))
    assert big.scale(Pass.F, micro_batch_size=1, seq_len=4096, device_type="A100-80GB", tp=2) < 0.53


@pytest.mark.parametrize("model", ["llama-2-7b", "opt-350m", "tiny"])
def test_sharded_parameters_halve_and_replicated_do_not(model: str) -> None:
    spec = get_model(model)
    block = formulas.layer_params(spec, 1)
    norms = 2 * spec.hidden_size * (2 if spec.norm == "layernorm" else 1)
    row_biases = 2 * spec.hidden_size if spec.bias else 0  # attention output and MLP down biases
    replicated = norms + row_biases
    assert formulas.layer_params(spec, 1, tp=2) == pytest.approx(replicated + (block - replicated) / 2)
    for layer in (0, spec.num_layers - 1):
        assert formulas.layer_held_params(spec, layer, tp=2) == formulas.layer_held_params(spec, layer)


@pytest.mark.parametrize("model", ["llama-2-7b", "opt-350m"])
def test_block_activations_split_inside_attention_and_mlp_only(model: str) -> None:
    spec = get_model(model)
    kw = {"micro_batch_size": 2, "seq_len": 256, "dtype_bytes": 2}
    tokens, h = 2 * 256, spec.hidden_size
    whole = formulas.layer_activation_bytes(spec, 1, **kw)
    kept = tokens * 4 * h * 2  # block input, attention-norm output, MLP-norm input and output
    assert formulas.layer_activation_bytes(spec, 1, tp=2, **kw) == pytest.approx(kept + (whole - kept) / 2)
    # Recomputation keeps the block input, whole on every rank.
    assert formulas.layer_activation_bytes(spec, 1, recompute=True, tp=4, **kw) == tokens * h * 2
    assert activation_scale(spec, 0, micro_batch_size=2, seq_len=256, dtype="bf16", tp=2) == (1.0, 1.0)
    full, after = activation_scale(spec, 1, micro_batch_size=2, seq_len=256, dtype="bf16", tp=2)
    assert 0.5 < full < 1.0 and 0.5 < after < 1.0
