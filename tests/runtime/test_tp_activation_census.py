"""What a block of medley's runtime saves for backward, against the formulas' count (the memory
model's activation bytes): the tensors tensor parallelism splits (Q, K and V as attention reads
them, the attention output twice, the MLP's inner tensors, the log-sum-exp) are exactly the
formulas' split part, and the hidden-size tensors every TP rank holds whole are at least the
formulas' four. A profile's measured block bytes (taken at tp 1) lose at tp only the split
tensors' share (:func:`medley.cost.tp_cost.tp_activation_bytes`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from medley.cost import formulas
from medley.cost.tp_cost import tp_activation_bytes
from medley.runtime.transformer import Block
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

MBS, SEQ = 2, 32
# q_dim (4 heads of 32) differs from hidden (64) and from kv_dim (2 heads), so each width is known.
WIDE_HEADS = dataclasses.replace(get_model("tiny"), explicit_head_dim=32)


def saved_storages(spec: ModelSpec) -> list[int]:
    """Bytes of each distinct storage one block's forward saves for backward (parameters left out)."""
    torch.manual_seed(0)
    block = Block(spec)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(MBS, SEQ, spec.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x)
    return list(seen.values())


@pytest.mark.parametrize("spec", [
    WIDE_HEADS,
    dataclasses.replace(WIDE_HEADS, num_kv_heads=WIDE_HEADS.num_heads),
    dataclasses.replace(WIDE_HEADS, mlp="gelu"),
], ids=["gqa-swiglu", "mha-swiglu", "gqa-gelu"])
def test_the_formulas_split_exactly_what_a_block_saves_split(spec: ModelSpec) -> None:
    tokens, d = MBS * SEQ, 4
    sizes = saved_storages(spec)
    split_widths = {spec.q_dim * tokens * d, spec.ffn_hidden_size * tokens * d, spec.num_heads * tokens * d}
    assert spec.hidden_size * tokens * d not in split_widths
    split = sum(b for b in sizes if b in split_widths)
    whole = sum(b for b in sizes if b == spec.hidden_size * tokens * d)
    kw = {"micro_batch_size": MBS, "seq_len": SEQ, "dtype_bytes": d}
    at = {tp: formulas.layer_activation_bytes(spec, 1, tp=tp, **kw) for tp in (1, 2)}
    assert at[1] - at[2] == split / 2  # what tp 2 saves per rank: half of the split tensors
    assert at[1] - split <= whole  # the formulas' whole tensors (4 x hidden) are all held


def test_a_measurement_loses_only_the_split_share() -> None:
    tiny, shape = get_model("tiny"), {"micro_batch_size": 2, "seq_len": 128}
    kw = {**shape, "dtype_bytes": 4}
    measured = (1.5e6, 2.2e6)  # more than the formulas name: the rest is whole on every rank
    held = tp_activation_bytes(tiny, 1, measured, dtype="fp32", tp=2, **shape)
    saved_f = (formulas.layer_activation_bytes(tiny, 1, **kw)
               - formulas.layer_activation_bytes(tiny, 1, tp=2, **kw))
    saved_w = (formulas.layer_activation_bytes_after_b(tiny, 1, **kw)
               - formulas.layer_activation_bytes_after_b(tiny, 1, tp=2, **kw))
    assert held == (measured[0] - saved_f, measured[1] - saved_w)
    assert tp_activation_bytes(tiny, 0, measured, dtype="fp32", tp=2, **shape) == measured  # embedding
    assert tp_activation_bytes(tiny, 1, (10.0, 10.0), dtype="fp32", tp=2, **shape) == (5.0, 5.0)


@pytest.mark.timeout(240)
def test_sequence_parallel_changes_memory_as_measured_at_tp2(tmp_path) -> None:
    """What a block saves per rank at tp 2 on gloo, with and without sequence parallelism,
    against the memory model's figure from the tp 1 measurement (a profile's number,
    :func:`tp_activation_bytes`): each within 5%, and SP's saving within 5% of the measured one
    (the norms' inputs and normalised inputs, the block input: sequence shards)."""
    from equality_worker import Case
    from test_equality import launch
    from tp_bytes_worker import count_saved_bytes

    case = Case(name="census", pp=1, dp=1, split=(SEQ,), zero=(0,), tp=(2,))  # split[0]: the sequence
    got = launch(2, [case], tmp_path, body=count_saved_bytes)[case.name]
    assert "error" not in got, got["error"]
    measured = float(sum(saved_storages(WIDE_HEADS)))  # tp 1, one process
    shape = {"micro_batch_size": MBS, "seq_len": SEQ}
    want = {sp: tp_activation_bytes(WIDE_HEADS, 1, (measured, measured), dtype="fp32", tp=2,
                                    sequence_parallel=sp, **shape)[0] for sp in (False, True)}
    print(f"tp1 {measured:.0f}; tp2 measured {got['tp']:.0f} predicted {want[False]:.0f}; "
          f"tp2+sp measured {got['sp']:.0f} predicted {want[True]:.0f}")
    assert want[False] == pytest.approx(got["tp"], rel=0.05)
    assert want[True] == pytest.approx(got["sp"], rel=0.05)
    assert want[False] - want[True] == pytest.approx(got["tp"] - got["sp"], rel=0.05)
    assert got["sp"] < got["tp"]
