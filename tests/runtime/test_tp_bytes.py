"""The runtime's TP communication against what the simulator times: per block of a tp2 stage,
Megatron's two all-reduces of the micro-batch's hidden states in the forward and two in the
backward (:data:`medley.cost.tensor_parallel.TP_ALL_REDUCES`, :func:`tp_all_reduce_bytes`),
counted on each of two gloo ranks as the functional collectives ``parallelize_module``'s DTensors
call (the ZeRO bytes test cannot see these: they bypass the ``torch.distributed`` calls it wraps).

Both match since the attention and the MLP share one replicated input among their column-wise
layers (:func:`medley.runtime.tensor_parallel.block_plan`); before, each of q, k, v, gate and up
all-reduced its own input gradient, five per SwiGLU block in the backward.
"""

from __future__ import annotations

import pytest
from equality_worker import MBS, SEQ, Case
from test_equality import launch
from tp_bytes_worker import count_tp_bytes

from medley.cost.interfaces import Pass
from medley.cost.tensor_parallel import TP_ALL_REDUCES, tp_all_reduce_bytes
from medley.spec.model_arg import get_model

BLOCKS = 3


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    case = Case(name="tp2-blocks", pp=1, dp=1, split=(BLOCKS,), zero=(0,), tp=(2,))
    got = launch(2, [case], tmp_path_factory.mktemp("tp_bytes"), body=count_tp_bytes)[case.name]
    assert "error" not in got, got["error"]
    assert "all_gather" not in got["F.other"] + got["B.other"], got  # no sequence parallelism
    return got


def _check(got: dict, kind: Pass, per_block: int) -> None:
    each = tp_all_reduce_bytes(get_model("tiny"), micro_batch_size=MBS, seq_len=SEQ, dtype="fp32")
    assert got[f"{kind.value}.calls"] == BLOCKS * per_block, got
    assert got[f"{kind.value}.bytes"] == BLOCKS * per_block * each, got


@pytest.mark.timeout(300)
def test_forward_all_reduces_equal_the_simulators(counted: dict) -> None:
    _check(counted, Pass.F, TP_ALL_REDUCES[Pass.F])


@pytest.mark.timeout(300)
def test_backward_all_reduces_equal_the_simulators(counted: dict) -> None:
    _check(counted, Pass.B, TP_ALL_REDUCES[Pass.B])
