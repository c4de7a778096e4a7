"""The runtime's TP communication against what the simulator times: per block of a tp2 stage,
Megatron's two all-reduces of the micro-batch's hidden states in the forward and two in the
backward (:data:`medley.cost.tp_cost.TP_ALL_REDUCES`, :func:`tp_all_reduce_bytes`),
counted on each of two gloo ranks as the functional collectives ``parallelize_module``'s DTensors
call (the ZeRO bytes test cannot see these: they bypass the ``torch.distributed`` calls it wraps).

Both match since the attention and the MLP share one replicated input among their column-wise
layers (:func:`medley.runtime.tensor_parallel.block_plan`); before, each of q, k, v, gate and up
all-reduced its own input gradient, five per SwiGLU block in the backward.

Under sequence parallelism the same stage issues per block two all-gathers and two
reduce-scatters of the hidden states each way (:data:`medley.cost.tp_cost.SP_COLLECTIVES`),
no all-reduce, and at its edges the all-gathers :func:`sequence_edge_collectives` books: one in F
(the whole output) and one in B (the whole input's gradient) when the edges carry whole tensors,
none when they carry sequence shards.
"""

from __future__ import annotations

import pytest
from equality_worker import MBS, SEQ, Case
from test_equality import launch
from tp_bytes_worker import count_tp_bytes, count_tp_bytes_sharded

from medley.cost.interfaces import Collective, Pass
from medley.cost.tp_cost import (
    TP_ALL_REDUCES,
    sequence_edge_collectives,
    tp_all_reduce_bytes,
    tp_collectives,
)
from medley.spec.model_arg import get_model

BLOCKS = 3


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    case = Case(name="tp2-blocks", pp=1, dp=1, split=(BLOCKS,), zero=(0,), tp=(2,))
    got = launch(2, [case], tmp_path_factory.mktemp("tp_bytes"), body=count_tp_bytes)[case.name]
    assert "error" not in got, got["error"]
    assert got["F.all_gather.calls"] + got["B.reduce_scatter.calls"] == 0, got  # no sequence parallelism
    return got


def _each() -> float:
    return tp_all_reduce_bytes(get_model("tiny"), micro_batch_size=MBS, seq_len=SEQ, dtype="fp32")


def _check(got: dict, kind: Pass, per_block: int) -> None:
    assert got[f"{kind.value}.all_reduce.calls"] == BLOCKS * per_block, got
    assert got[f"{kind.value}.all_reduce.bytes"] == BLOCKS * per_block * _each(), got


@pytest.mark.timeout(300)
def test_forward_all_reduces_equal_the_simulators(counted: dict) -> None:
    _check(counted, Pass.F, TP_ALL_REDUCES[Pass.F])


@pytest.mark.timeout(300)
def test_backward_all_reduces_equal_the_simulators(counted: dict) -> None:
    _check(counted, Pass.B, TP_ALL_REDUCES[Pass.B])


@pytest.fixture(scope="module")
def counted_sp(tmp_path_factory) -> dict[bool, dict]:
    """The sequence-parallel stage with whole edges (False) and with sharded edges (True)."""
    case = Case(name="tp2-sp-blocks", pp=1, dp=1, split=(BLOCKS,), zero=(0,), tp=(2,), sequence_parallel=True)
    out = {}
    for sharded, body in ((False, count_tp_bytes), (True, count_tp_bytes_sharded)):
        got = launch(2, [case], tmp_path_factory.mktemp("tp_bytes_sp"), body=body)[case.name]
        assert "error" not in got, got["error"]
        out[sharded] = got
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded", [False, True], ids=["whole-edges", "sharded-edges"])
@pytest.mark.parametrize("kind", [Pass.F, Pass.B])
def test_sequence_parallel_collectives_equal_the_simulators(counted_sp: dict, sharded: bool,
                                                            kind: Pass) -> None:
    got = counted_sp[sharded]
    edge = sequence_edge_collectives(kind, whole_input=not sharded, whole_output=not sharded)
    want = {op: BLOCKS * n for op, n in tp_collectives(kind, sequence_parallel=True).items()}
    want[Collective.ALL_GATHER] = want.get(Collective.ALL_GATHER, 0) + edge
    for op in Collective:
        assert got[f"{kind.value}.{op.value}.calls"] == want.get(op, 0), (op, got)
        assert got[f"{kind.value}.{op.value}.bytes"] == want.get(op, 0) * _each(), (op, got)
    assert want[Collective.REDUCE_SCATTER] == 2 * BLOCKS and Collective.ALL_REDUCE not in want
