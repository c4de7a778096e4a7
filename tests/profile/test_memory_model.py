"""The fp32 memory model against what medley's runtime holds (bench/results/runtime.md measures it):
4 B weights, 4 B gradients and 8 B AdamW moments per parameter, and with dp > 1 the buffers
around ZeRO collectives. The bf16 mixed-precision accounting stays the ZeRO paper's."""

from __future__ import annotations

import pytest

from medley.cost.estimator import CatalogCostSource
from medley.cost.formulas import layer_held_params
from medley.cost.zero_memory import (
    BF16_ADAM,
    FP32_ADAM,
    MIXED_PRECISION_ADAM,
    stage_state_bytes,
    state_bytes_per_param,
)
from medley.plan.compile import compile_problem
from medley.plan.layout import PlanLayout
from medley.schedule.ir import Kind
from medley.schedule.zero_settings import StageZero
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

TINY = get_model("tiny")
PARAMS = float(sum(layer_held_params(TINY, i) for i in range(TINY.num_layers)))


def _problem(level: int, dtype: str, dp: int = 2):
    layout = PlanLayout(model=TINY, pp=1, dp=dp, assignment=tuple((r,) for r in range(dp)),
                        stage_layers=(TINY.num_layers,), schedule="1f1b", micro_batches=(2,) * dp,
                        micro_batch_size=1, seq_len=32, zero=(StageZero(level=level),), dtype=dtype)
    cluster = parse_cluster_arg(f"{dp}xCPU")
    return compile_problem(layout, cluster, CatalogCostSource.for_cluster(TINY, cluster, dtype=dtype))


def test_bytes_per_parameter_by_dtype() -> None:
    assert state_bytes_per_param("fp32") == FP32_ADAM
    assert state_bytes_per_param("bf16") == BF16_ADAM  # fp32 gradients, as Megatron-LM and torchtitan
    assert state_bytes_per_param("fp16") == MIXED_PRECISION_ADAM
    assert BF16_ADAM.weights + BF16_ADAM.grads + BF16_ADAM.optimizer == 18.0
    fp32 = stage_state_bytes(1000.0, level=1, dp=2, per_param=FP32_ADAM)
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4000.0, 4000.0, 4000.0)
    assert stage_state_bytes(1000.0, level=0, dp=1).resident == 16000.0  # fp16: 2 + 2 + 12


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_fp32_collective_buffers(level: int) -> None:
    problem = _problem(level, "fp32")
    schedule = problem.schedules[0]
    action = next(a for a in schedule.actions[0] if a.kind is Kind.REDUCE_GRAD)
    reduce = problem.collectives(0, action)
    # Level 0: the flat all-reduce buffer and the reduced copy; levels 1-3 (FSDP2): the new shard.
    assert reduce.alloc_bytes == pytest.approx(PARAMS * 4 * (2 if level == 0 else 0.5))
    static = problem.static_memory_bytes[0]
    # Levels 1-2 keep the fp32 shards the optimizer steps next to the gathered weights.
    expected = {0: 16.0, 1: 4 + 4 + 4 + 2.0, 2: 4 + 2 + 4 + 2.0, 3: 2 + 2 + 4.0}[level] * PARAMS
    assert static == pytest.approx(expected)
    if level == 3:
        unshard = next(a for a in schedule.actions[0] if a.kind is Kind.UNSHARD)
        assert problem.collectives(0, unshard).alloc_bytes == pytest.approx(PARAMS * 4)  # shard kept too


def test_bf16_and_single_replica_keep_the_paper_accounting() -> None:
    for problem in (_problem(3, "bf16"), _problem(0, "fp32", dp=1)):
        action = next(a for a in problem.schedules[0].actions[0] if a.kind is Kind.REDUCE_GRAD)
        assert problem.collectives(0, action).alloc_bytes == 0.0
    bf16 = _problem(3, "bf16")
    unshard = next(a for a in bf16.schedules[0].actions[0] if a.kind is Kind.UNSHARD)
    assert bf16.collectives(0, unshard).alloc_bytes == pytest.approx(PARAMS * 2 / 2)
