"""Replay (medley.fidelity.replay): a measured step's compute durations, read from the
runtime's per-action timings, drive the simulator; transfers stay modelled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from medley.fidelity.cases import TINY
from medley.fidelity.loop import run_case
from medley.fidelity.plans import FidelityCase
from medley.fidelity.replay import MeasuredStep, replay_step, step_durations
from medley.schedule.ir import BW, F, Kind, PipelineSchedule, add_send_recv
from medley.sim import SimProblem, StageCost, simulate


def gpipe_problem() -> SimProblem:
    """Two stages, two micro-batches, F 1 s and BW 2 s: a 9 s step without communication."""
    rows = [[F(s, i) for i in range(2)] + [BW(s, i) for i in range(2)] for s in range(2)]
    schedule = PipelineSchedule(family="gpipe", num_stages=2, num_micro_batches=2, stage_to_rank=(0, 1),
                                actions=rows)
    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1)
    return SimProblem(schedules=[schedule], devices=[[0, 1]], stage_costs=[[cost, cost]])


def spans_of(problem: SimProblem, seconds: dict[str, float]) -> dict[int, list[tuple[str, float, float]]]:
    """What the runtime records: its lowered program (transfers placed), back to back; every
    action takes ``seconds`` of its text (0.25 s if not named)."""
    lowered = add_send_recv(problem.schedules[0])
    out = {}
    for device, row in zip(problem.devices[0], lowered.actions, strict=True):
        t, spans = 0.0, []
        for action in row:
            took = seconds.get(str(action), 0.25 if action.kind in (Kind.SEND_F, Kind.SEND_B) else 0.0)
            spans.append((str(action), t, t + took))
            t += took
        out[device] = spans
    return out


def traced(problem: SimProblem, seconds: dict[str, float],
           starts: tuple[float, float] = (0.0, 0.0)) -> MeasuredStep:
    spans = spans_of(problem, seconds)
    return MeasuredStep(spans=spans, starts=dict(enumerate(starts)),
                        elapsed={d: rows[-1][2] for d, rows in spans.items()})


def test_measured_compute_with_its_send_postings_replaces_the_model():
    problem = gpipe_problem()
    measured = {"0F0": 2.0, "0F1": 1.0, "0BW0": 3.0, "0BW1": 3.0, "1F0": 1.0, "1F1": 1.0, "1BW0": 1.0,
                "1BW1": 1.0, "0SEND_F0": 0.5}
    durations = step_durations(problem, spans_of(problem, measured))
    assert durations[0][F(0, 0)] == 2.5  # its own 2 s and the 0.5 s posting its send
    assert durations[0][F(0, 1)] == 1.25 and durations[0][BW(0, 0)] == 3.0
    assert durations[1][BW(1, 0)] == 1.25  # the gradient's send back
    # By hand: 1F0 at 2.5-3.5, 1F1 at 3.75-4.75 (0F1 ends at 3.75), 1BW0 4.75-6, 1BW1 6-7.25,
    # 0BW0 waits for 1BW0 (6) to 9, 0BW1 to 12.
    assert replay_step(problem, traced(problem, measured)) == 12.0
    assert simulate(problem).step_time_s == 9.0  # the modelled durations would say 9
    # Device 1 began 4 s after device 0 (on the machine's clock): 1F0 runs 4-5, 1BW0 6-7.25,
    # 1BW1 7.25-8.5, so 0BW0 runs 7.25-10.25 and 0BW1 10.25-13.25.
    late = traced(problem, measured, starts=(100.0, 104.0))
    assert late.skew_s == {0: 0.0, 1: 4.0}
    assert late.elapsed == {0: 9.75, 1: 4.5} and late.world_s == 9.75  # device 0 ends last
    assert replay_step(problem, late) == 13.25


def test_a_program_unlike_the_simulators_is_refused():
    problem = gpipe_problem()
    spans = spans_of(problem, {})
    spans[1] = [s for s in spans[1] if s[0] != "1BW1"]
    with pytest.raises(ValueError, match="device 1 ran 3 actions"):
        step_durations(problem, spans)
    with pytest.raises(ValueError, match="trace_actions"):
        step_durations(problem, {0: spans[0]})


@pytest.mark.timeout(300)
def test_a_tiny_pipeline_run_is_replayed_from_its_own_timings(profile, tmp_path: Path) -> None:
    """Train a tiny pp2 plan with action tracing: every timed step is replayed, and the replay's
    compute on each rank is what that rank measured (so a replay ignoring the timings fails)."""
    case = FidelityCase(name="pp2", model=TINY, pp=2, dp=1, split="2,2", zero="0,0", seq_len=64,
                        micro_batch_size=1)
    result = run_case(case, profile, profile_name="hand.json", directory=tmp_path, steps=4, warmup_steps=1)
    assert len(result.replay_step_s) == len(result.replay_measured_s) == 3
    # From the first rank's start to the last one's end: at least the slowest rank's own step.
    assert all(world >= own for world, own in zip(result.replay_measured_s, result.step_times_s[1:],
                                                   strict=True))
    assert 0 <= result.replay_skew_s < min(result.replay_measured_s)
    assert all(s > 0 for s in result.replay_step_s)
    # The hand-made profile's layers are far faster than this CPU's: the same problem on its
    # modelled durations predicts a fraction of the measured step, and only the measured
    # durations lift the replay well above that (a replay that ignored them would equal it).
    assert result.predicted_step_s < 0.5 * min(result.replay_measured_s)
    assert min(result.replay_step_s) > 2 * result.predicted_step_s
    assert result.world == 2 and result.replay_errors == pytest.approx(
        [(s - m) / m for s, m in zip(result.replay_step_s, result.replay_measured_s, strict=True)])


def test_replay_uses_every_ranks_own_seconds():
    problem = gpipe_problem()
    slow = spans_of(problem, {"1BW0": 5.0, "1BW1": 5.0})
    durations = step_durations(problem, slow)
    result = simulate(dataclasses.replace(problem, duration_overrides=durations))
    assert [(str(a), e - s) for s, e, a in result.compute[1]] == [
        ("1F0", 0.0), ("1F1", 0.0), ("1BW0", 5.25), ("1BW1", 5.25)]
