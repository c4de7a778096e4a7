import pytest

from medley.cost.zero_memory import stage_state_bytes, zero_paper_bytes

PSI = 7.5e9  # the ZeRO paper's running example: a 7.5 B-parameter model


@pytest.mark.parametrize(
    ("level", "dp", "expected_gb"),
    # The paper's Figure 1: 7.5 B parameters over 64 devices, K = 12.
    [(0, 64, 120.0), (1, 64, 31.4), (2, 64, 16.6), (3, 64, 1.9)],
)
def test_matches_zero_paper_figure_1(level: int, dp: int, expected_gb: float) -> None:
    assert zero_paper_bytes(PSI, level=level, dp=dp) / 1e9 == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 4, 16])
def test_resident_state_is_the_paper_formula(level: int, dp: int) -> None:
    state = stage_state_bytes(PSI, level=level, dp=dp, gathered_fraction=0.0, accumulation_fraction=0.0)
    assert state.peak == pytest.approx(zero_paper_bytes(PSI, level=level, dp=dp))


def test_hand_computed_level_3_with_full_gather_and_full_accumulation() -> None:
    # 1 B params over 4 devices: shards of 0.25 B params.
    state = stage_state_bytes(1e9, level=3, dp=4)
    assert state.weights == pytest.approx(0.5e9)  # 2 B/param of the shard
    assert state.grads == pytest.approx(0.5e9)
    assert state.optimizer == pytest.approx(3e9)  # 12 B/param of the shard
    assert state.gathered_weights == pytest.approx(1.5e9)  # the other three shards, gathered
    assert state.grad_accumulation == pytest.approx(1.5e9)  # unsharded accumulation buffer
    assert state.peak == pytest.approx(7e9)


def test_hand_computed_level_2_bucketed_accumulation() -> None:
    # Level 2 keeps full weights; a quarter-stage bucket of gradient is unsharded at the peak.
    state = stage_state_bytes(1e9, level=2, dp=2, accumulation_fraction=0.25)
    assert state.weights == pytest.approx(2e9)
    assert state.grads == pytest.approx(1e9)
    assert state.optimizer == pytest.approx(6e9)
    assert state.gathered_weights == 0.0
    assert state.grad_accumulation == pytest.approx(0.25e9)


def test_no_transient_buffers_without_data_parallelism() -> None:
    state = stage_state_bytes(1e9, level=3, dp=1)
    assert state.peak == pytest.approx(16e9)


def test_rejects_bad_level_and_group() -> None:
    with pytest.raises(ValueError, match="ZeRO level"):
        stage_state_bytes(1.0, level=4, dp=2)
    with pytest.raises(ValueError, match="data-parallel size"):
        stage_state_bytes(1.0, level=1, dp=0)
