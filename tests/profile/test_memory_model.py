"""The memory model against what medley's runtime holds (bench/results/fidelity.md measures it):
fp32: 4 B weights, 4 B gradients and 8 B AdamW moments per parameter; bf16: 2 B gathered
weights, 4 B fp32 gradients, 12 B of fp32 master and moments; with dp > 1 FSDP2's shards and the
buffers around ZeRO collectives (medley.cost.zero_memory's table)."""

from __future__ import annotations

import pytest
import torch

from medley.cost.estimator import CatalogCostSource
from medley.cost.formulas import layer_autocast_params, layer_held_params
from medley.cost.zero_memory import (
    BF16_ADAM,
    FP32_ADAM,
    MIXED_PRECISION_ADAM,
    stage_state_bytes,
    state_bytes_per_param,
)
from medley.lowering.compile import compile_problem
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
    assert (fp32.weights, fp32.optimizer, fp32.gradient, fp32.grad_shard) == (6000.0, 4000.0, 4000.0, 2000.0)
    # fp16 at level 0: the fp32 master's 4 B gradient + 12 B master and moments; the fp16
    # weights are autocast's per-micro-batch copies, with the activations. Under FSDP2 the
    # gradient accumulates in fp16 (2 B) and its reduced shard is the fp32 shard's (4 B / d).
    assert stage_state_bytes(1000.0, level=0, dp=1).peak == 16000.0
    fp16_zero1 = stage_state_bytes(1000.0, level=1, dp=2, per_param=MIXED_PRECISION_ADAM)
    assert (fp16_zero1.gradient, fp16_zero1.grad_shard) == (2000.0, 2000.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_without_fsdp2_the_gradient_is_the_fp32_masters(dtype: torch.dtype) -> None:
    """What the level-0 booking rests on: autocast computes in half precision from the fp32
    weights, and autograd hands the fp32 weights an fp32 gradient."""
    from medley.runtime.transformer import Block

    block = Block(TINY)
    with torch.autocast("cpu", dtype=dtype):
        out = block(torch.randn(1, 8, TINY.hidden_size))
    out.float().sum().backward()
    assert {p.grad.dtype for p in block.parameters()} == {torch.float32}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_collective_buffers_and_static_state(level: int, dtype: str) -> None:
    """What the compiler books is zero_memory's table, in both precisions: static state, the
    gradient made by the backward, ZeRO-3's whole gather, and the reductions' buffers."""
    per = state_bytes_per_param(dtype)
    problem = _problem(level, dtype)
    schedule = problem.schedules[0]
    action = next(a for a in schedule.actions[0] if a.kind is Kind.REDUCE_GRAD)
    reduce = problem.collectives(0, action)
    # Level 0: the flat all-reduce buffer, which becomes the reduced gradient; levels 1-3
    # (FSDP2): the new gradient shard and the reduce-scatter input (one bucket: the stage).
    # Every level frees the unsharded gradient.
    assert reduce.alloc_bytes == pytest.approx(PARAMS * per.grads * (1.5 if level else 1))
    assert reduce.free_bytes == pytest.approx(PARAMS * per.grads)
    assert problem.stage_costs[0][0].grad_buffer_bytes == pytest.approx(PARAMS * per.grads)
    # Static: weights (fp32 levels 1-3 also the stepped shard) and optimizer state.
    shard = 0.0 if dtype == "bf16" or level == 0 else 2.0
    plain = per.weights if dtype == "fp32" else 0.0  # bf16 level 0: autocast's copies only
    weights = {0: plain, 1: per.weights + shard, 2: per.weights + shard, 3: shard}[level]
    optimizer = per.optimizer / (2 if level else 1)
    assert problem.static_memory_bytes[0] == pytest.approx((weights + optimizer) * PARAMS)
    if level == 3:
        unshard = next(a for a in schedule.actions[0] if a.kind is Kind.UNSHARD)
        assert problem.collectives(0, unshard).alloc_bytes == pytest.approx(PARAMS * per.weights)


def test_single_replica_books_no_collective_buffers() -> None:
    problem = _problem(0, "fp32", dp=1)
    action = next(a for a in problem.schedules[0].actions[0] if a.kind is Kind.REDUCE_GRAD)
    assert problem.collectives(0, action).alloc_bytes == 0.0


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_autocast_copies_live_until_the_weight_gradient() -> None:
    """At level 0 a half-precision forward casts the fp32 weights under autocast; the matmuls'
    autograd nodes keep the copies until W releases them, so a split B does not free them (torch,
    measured here) and the compiler books them in the bytes held between B and W."""
    import torch

    from medley.profile.layer_build import ProfiledLayer, build_layer, layer_inputs
    from medley.profile.layers import measure_live_activations

    cpu = torch.device("cpu")
    x, targets = layer_inputs(TINY, "block", 2, 32, torch.bfloat16, cpu)
    half = measure_live_activations(build_layer(TINY, "block", torch.bfloat16, cpu), x, targets)
    master = build_layer(TINY, "block", torch.float32, cpu)

    def cast_forward(inp: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return master.forward(inp, tgt)

    level0 = measure_live_activations(ProfiledLayer(kind="block", module=master.module, forward=cast_forward),
                                      x, targets)
    copies = 2 * layer_autocast_params(TINY, 1)
    assert level0[0] - half[0] == copies  # after F
    assert level0[1] - half[1] == copies  # after B: still held

    def block_costs(level: int):
        stage = _problem(level, "bf16").stage_costs[0][0]
        return stage.activation_bytes, stage.activation_after_b_bytes

    (act0, after0), (act1, after1) = block_costs(0), block_costs(1)
    all_copies = 2 * sum(layer_autocast_params(TINY, i) for i in range(TINY.num_layers))
    assert act0 - act1 == pytest.approx(all_copies)
    assert after0 - after1 == pytest.approx(all_copies)
