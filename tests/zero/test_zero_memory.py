import pytest

from medley.cost.zero_memory import (
    BF16_ADAM,
    FP32_ADAM,
    MIXED_PRECISION_ADAM,
    autocast_copy_bytes,
    stage_state_bytes,
    zero_paper_bytes,
)

PSI = 7.5e9  # the ZeRO paper's running example: a 7.5 B-parameter model


@pytest.mark.parametrize(
    ("level", "dp", "expected_gb"),
    # The paper's Figure 1: 7.5 B parameters over 64 devices, K = 12.
    [(0, 64, 120.0), (1, 64, 31.4), (2, 64, 16.6), (3, 64, 1.9)],
)
def test_matches_zero_paper_figure_1(level: int, dp: int, expected_gb: float) -> None:
    assert zero_paper_bytes(PSI, level=level, dp=dp) / 1e9 == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("dp", [2, 4, 16])
def test_fp16_state_is_the_paper_formula_but_for_fp32_gradients(level: int, dp: int) -> None:
    """In half precision the stepped FSDP2 shard is the master the optimizer's 12 B count, so
    level 1 holds the paper's bytes once the gradient exists. Where the gradient is the fp32
    master's it takes 4 B, not the paper's 2: level 0's whole gradient (autograd differentiates
    the fp32 weights; the fp16 weights are autocast's per-micro-batch copies, one micro-batch in
    flight here) and level 2's reduced shard (FSDP2 reduces into its fp32 shard)."""
    state = stage_state_bytes(PSI, level=level, dp=dp, per_param=MIXED_PRECISION_ADAM)
    held = state.resident + (state.gradient if level < 2 else state.grad_shard)
    held += PSI * autocast_copy_bytes(level=level, dp=dp, per_param=MIXED_PRECISION_ADAM)
    fp32_gradients = {0: 2 * PSI, 1: 0.0, 2: 2 * PSI / dp}[level]
    assert held == pytest.approx(zero_paper_bytes(PSI, level=level, dp=dp) + fp32_gradients)


def test_level_3_keeps_no_half_precision_shard() -> None:
    """FSDP2 gathers the bf16 weights from the fp32 master shard: between steps 12/d, not the
    paper's 16/d; at the peak the whole stage gathered (2), its gradient (4) and shard (4/d), and
    a quarter-stage bucket's reduce-scatter input (4/4)."""
    state = stage_state_bytes(1e9, level=3, dp=4, per_param=BF16_ADAM, bucket_fraction=0.25)
    assert (state.weights, state.optimizer) == pytest.approx((0.0, 3e9))
    assert (state.gathered_weights, state.gradient, state.grad_shard) == pytest.approx((2e9, 4e9, 1e9))
    assert state.reduce_buffer == pytest.approx(1e9)
    assert state.peak == pytest.approx(11e9)


@pytest.mark.parametrize("level", [1, 2])
def test_fp32_levels_1_2_keep_the_stepped_shard_next_to_the_gathered_weights(level: int) -> None:
    # 1000 params over 2: 4000 gathered + 2000 shard; moments 8 B of the shard; the gradient
    # (4000) and, after the reduce-scatter, its shard (2000).
    state = stage_state_bytes(1000.0, level=level, dp=2, per_param=FP32_ADAM)
    assert state.weights == pytest.approx(6000.0)
    assert state.optimizer == pytest.approx(4000.0)
    assert (state.gathered_weights, state.gradient, state.grad_shard) == (0.0, 4000.0, 2000.0)


def test_fp32_level_3_gathers_the_whole_stage_next_to_its_shard() -> None:
    state = stage_state_bytes(1000.0, level=3, dp=2, per_param=FP32_ADAM)
    assert (state.weights, state.grad_shard, state.optimizer) == pytest.approx((2000.0, 2000.0, 4000.0))
    assert state.gathered_weights == pytest.approx(4000.0)
    assert state.peak == pytest.approx(16000.0 + 4000.0)  # + one bucket's (here the stage's) reduction


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_no_sharding_without_data_parallelism(level: int) -> None:
    state = stage_state_bytes(1e9, level=level, dp=1, per_param=BF16_ADAM)
    # No bf16 weights held: autocast computes from the fp32 master (the optimizer's 12 B count
    # it), copying 2 B per weight per micro-batch in flight.
    assert (state.weights, state.grad_shard, state.optimizer, state.gathered_weights) == (0.0, 0.0, 12e9, 0.0)
    assert autocast_copy_bytes(level=level, dp=1, per_param=BF16_ADAM) == 2.0
    assert autocast_copy_bytes(level=level, dp=2, per_param=BF16_ADAM) == (2.0 if level == 0 else 0.0)
    assert autocast_copy_bytes(level=level, dp=1, per_param=FP32_ADAM) == 0.0
    assert state.reduce_buffer == 0.0  # nothing to reduce
    assert state.gradient == 4e9  # made by the backward, not kept between steps


def test_rejects_bad_level_and_group() -> None:
    with pytest.raises(ValueError, match="ZeRO level"):
        stage_state_bytes(1.0, level=4, dp=2)
    with pytest.raises(ValueError, match="data-parallel size"):
        stage_state_bytes(1.0, level=1, dp=0)


def test_level_0_reduces_in_a_flat_buffer_of_its_largest_bucket() -> None:
    state = stage_state_bytes(1000.0, level=0, dp=2, per_param=FP32_ADAM, bucket_fraction=0.5)
    assert (state.weights, state.optimizer, state.gradient) == (4000.0, 8000.0, 4000.0)
    assert (state.grad_shard, state.reduce_buffer) == (0.0, 2000.0)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_one_replica_runs_every_level_as_level_0(level: int) -> None:
    """With dp = 1 there is nothing to shard: the runtime builds level 0's stage (no FSDP2 unit,
    which over one rank held the weights twice), the state the memory model books there."""
    import torch

    from medley.runtime.sharding import shard_stage
    from medley.runtime.transformer import Decoder
    from medley.spec.model_arg import get_model

    tiny = get_model("tiny")
    stage = shard_stage(Decoder(tiny, seed=0), zero=level, bucket_layers=None, dp_mesh=None,
                        optimizer_class=torch.optim.AdamW, optimizer_kwargs={}, precision="bf16")
    assert stage.zero == 0 and not stage.sharded and not stage.fsdp_units
    alone = stage_state_bytes(PSI, level=level, dp=1, per_param=BF16_ADAM)
    assert alone == stage_state_bytes(PSI, level=0, dp=1, per_param=BF16_ADAM)
