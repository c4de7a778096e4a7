"""The fidelity checks fail a broken simulator, and the report's prose comes from its data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medley.cost.profile_format import load_profile
from medley.fidelity.cases import TINY, planned_cases
from medley.fidelity.fidelity_report import markdown_from_payload, payload_of
from medley.fidelity.plans import case_groups, describe, emulate, tags
from medley.fidelity.results import FidelityResult, memory_failure, timing_failure


def _result(
    name: str,
    *,
    predicted_ms: float,
    fastest_ms: float,
    memory: tuple[float, float] = (1e6, 1e6),
    dtype: str = "fp32",
) -> FidelityResult:
    return FidelityResult(
        case=name,
        plan="pp2 dp1",
        predicted_step_s=predicted_ms / 1e3,
        loaded_predicted_step_s=predicted_ms / 1e3,
        measured_step_s=fastest_ms * 1.1 / 1e3,
        fastest_step_s=fastest_ms / 1e3,
        predicted_memory={0: memory[0]},
        measured_memory={0: memory[1]},
        cost_source="profile:p.json",
        compute_share=1.0,
        loaded_compute_share=1.0,
        background_cores=0.1,
        wall_s=1.0,
        dtype=dtype,
        predicted_no_overhead_s=predicted_ms * 0.8 / 1e3,
        tags=["pipeline", dtype],
        breakdown={
            "device": 0.0,
            "compute_s": predicted_ms * 0.8 / 1e3,
            "overhead_s": 1e-3,
            "bubble_s": 0.0,
            "exposed_transfer_s": predicted_ms * 0.2 / 1e3,
            "exposed_zero_s": 0.0,
            "compute_actions": 8.0,
            "transfers": 4.0,
        },
    )


def test_a_simulator_off_by_half_fails_the_timing_bound() -> None:
    halved = [
        _result("a", predicted_ms=20.0, fastest_ms=40.0),
        _result("b", predicted_ms=30.0, fastest_ms=60.0),
    ]
    failure = timing_failure(halved, bound=0.35)
    assert failure is not None and "50%" in failure and "a 20.0 ms predicted vs 40.0 ms fastest" in failure
    doubled = [
        _result("a", predicted_ms=80.0, fastest_ms=40.0),
        _result("b", predicted_ms=60.0, fastest_ms=60.0),
    ]
    assert timing_failure(doubled, bound=0.35) is not None  # median of 100% and 0%
    close = [
        _result("a", predicted_ms=36.0, fastest_ms=40.0),
        _result("b", predicted_ms=70.0, fastest_ms=60.0),
    ]
    assert timing_failure(close, bound=0.35) is None


def test_a_replay_off_by_four_fails_the_quick_tests_replay_bound() -> None:
    """test_fidelity_quick holds each plan's median replay error (the step simulated on its own
    measured compute) to REPLAY_BOUND: a simulator that loses three quarters of the step, or
    quadruples it, fails; the bench's worst plan (27.5%) passes."""
    import dataclasses

    from test_fidelity_quick import REPLAY_BOUND

    def median_error(replayed: list[float], measured: list[float]) -> float:
        result = dataclasses.replace(_result("a", predicted_ms=1.0, fastest_ms=1.0), replay_step_s=replayed,
                                     replay_measured_s=measured)
        errors = sorted(abs(e) for e in result.replay_errors)
        return errors[len(errors) // 2]

    assert median_error([0.025, 0.024, 0.026], [0.1, 0.1, 0.1]) > REPLAY_BOUND  # a quarter of the step
    assert median_error([0.4, 0.41, 0.39], [0.1, 0.1, 0.1]) > REPLAY_BOUND  # four times it
    assert median_error([0.1275, 0.12, 0.13], [0.1, 0.1, 0.1]) <= REPLAY_BOUND


def test_memory_bound_names_the_rank() -> None:
    assert (
        memory_failure([_result("a", predicted_ms=1.0, fastest_ms=1.0, memory=(1.1e6, 1e6))], bound=0.15)
        is None
    )
    failure = memory_failure(
        [_result("a", predicted_ms=1.0, fastest_ms=1.0, memory=(0.5e6, 1e6))], bound=0.15
    )
    assert failure == "a device 0: peak memory off by -50.0% (bound 15%)"


def test_report_prose_is_computed_from_the_json() -> None:
    results = [
        _result("a", predicted_ms=36.0, fastest_ms=40.0),
        _result("b", predicted_ms=90.0, fastest_ms=60.0, memory=(1.3e6, 1e6), dtype="bf16"),
    ]
    meta = {
        "host": "h",
        "cores": 2,
        "commit": "abc123",
        "command": "python bench/fidelity.py",
        "overhead": {"tiny": {"action_s": 2e-4, "p2p_handoff_s": 5e-5, "figures": {"handoff_s": 3e-4}}},
    }
    text = markdown_from_payload(json.loads(json.dumps(payload_of(results, meta))))
    assert "Commit abc123; command `python bench/fidelity.py`" in text
    # medians of |-10%| and |+50%|: 30%; one of two under-predicted
    assert (
        "median |error| 30.0% against the fastest step (worst 50.0%" in text
        and "1 of 2 under-predicted" in text
    )
    assert "The worst step-time case is b" in text and "adds 30.0 ms" in text
    assert "median |error| 0.0% in fp32 (worst 0.0%); median |error| 30.0% in bf16 (worst 30.0%)." in text
    assert "The worst peak-memory case is b device 0" in text
    assert "200 µs per compute action, 50 µs per transfer" in text
    assert "| bf16 | 1 | +50.0% |" in text


@pytest.mark.parametrize("bound", [0.0, 0.1])
def test_exact_predictions_pass_any_bound(bound: float) -> None:
    exact = [_result("a", predicted_ms=40.0, fastest_ms=40.0)]
    assert timing_failure(exact, bound=bound) is None


def test_planned_case_runs_the_planners_plan(tmp_path: Path) -> None:
    """A planned case is the planner's ranked plan on the emulated cluster, in the case's precision."""
    profile = load_profile(Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json")
    case = planned_cases(top=1)[0]
    emulated, _ = emulate(case, profile, profile_name="p.json", directory=tmp_path, cores=2)
    groups = case_groups(case, emulated)  # alike replicas, or replica groups of their own shape
    for layout in groups:  # the planner always clips
        assert layout.model == TINY and layout.dtype == "bf16" and layout.clip_grad
    assert sum(sum(g.micro_batches) for g in groups) * groups[0].micro_batch_size == case.global_batch
    assert "planner's plan" in tags(groups, case) and "bf16" in describe(groups)


def test_compute_and_rest_errors_split_the_busiest_device() -> None:
    r = _result("split", predicted_ms=10.0, fastest_ms=12.0)  # predicted compute 8 ms, rest 2 ms
    r.measured_by_device = {0: 13.0e-3}
    r.measured_actions_by_device = {
        0: {"compute": 9.0e-3, "optim": 1.0e-3, "transfer": 2.5e-3, "zero": 0.5e-3, "clip": 0.0}}
    assert r.compute_error == pytest.approx(-0.2)  # 8 ms against 9 + 1
    assert r.rest_error == pytest.approx(-1 / 3)  # 2 ms against 3
    unknown = _result("unmeasured", predicted_ms=10.0, fastest_ms=12.0)
    assert unknown.compute_error != unknown.compute_error  # nan: an old report without the field
    text = markdown_from_payload(payload_of([r, unknown], {"commit": "x", "command": "y"}))
    assert "is predicted -20.0%" in text and "rest of its step (bubble" in text
    assert "-33.3%" in text
    assert "2.5 ms in transfers and waits for them against 2.0 ms" in text


def test_noise_is_the_spread_of_identical_compute_between_steps() -> None:
    r = _result("noisy", predicted_ms=10.0, fastest_ms=12.0)
    r.busiest_compute_s = [8e-3, 10e-3, 12e-3, 9e-3, 16e-3]  # median 10 ms, fastest 8 ms
    assert r.compute_spread == pytest.approx(0.25)
    quiet = _result("quiet", predicted_ms=10.0, fastest_ms=12.0)
    assert quiet.compute_spread != quiet.compute_spread  # nan: not measured
    payload = payload_of([r, quiet], {"commit": "x", "command": "y"})
    text = markdown_from_payload(json.loads(json.dumps(payload)))
    assert "took a median +25.0% longer in its median step than in its fastest (worst +25.0%" in text
