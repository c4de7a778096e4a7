"""``SimProblem.duration_overrides``: measured seconds replace the compiled durations of the compute
stream's actions (F, B, W, BW, OPTIM), and nothing else moves (the fidelity study's replay)."""

from __future__ import annotations

import dataclasses

import pytest
from sim_doubles import uniform_problem
from test_engine import spans, two_stage_gpipe
from test_zero import zero3_problem

from medley.schedule.ir import BW, Action, F, Kind
from medley.sim import simulate


def test_overridden_compute_takes_the_given_seconds_and_the_rest_follows():
    problem = uniform_problem(two_stage_gpipe(), f=1, b=1, w=1)  # F 1 s, BW 2 s: a 9 s step
    replayed = dataclasses.replace(problem, duration_overrides={0: {F(0, 0): 3.0, BW(0, 1): 0.5},
                                                                1: {F(1, 1): 2.0}})
    result = simulate(replayed)
    # Worked by hand: device 1's forwards wait for device 0's, device 0's backwards for device 1's.
    assert spans(result, 0) == [(0, 3, "0F0"), (3, 4, "0F1"), (8, 10, "0BW0"), (10, 10.5, "0BW1")]
    assert spans(result, 1) == [(3, 4, "1F0"), (4, 6, "1F1"), (6, 8, "1BW0"), (8, 10, "1BW1")]
    assert result.step_time_s == 10.5
    assert simulate(problem).step_time_s == 9  # the problem itself is unchanged


def test_the_optimizer_step_takes_the_measured_seconds_and_collectives_stay_modelled():
    problem = zero3_problem()
    replayed = simulate(dataclasses.replace(problem, duration_overrides={
        0: {Action(0, Kind.OPTIM): 4.0, Action(0, Kind.BW, 0): 1.0}}))
    # The reduce-scatter still takes its 5 s once both replicas issued it (replica 1 at 11 s).
    assert [(c[1], c[2], str(c[3])) for c in replayed.collectives] == [
        (0.0, 5.0, "0UNSHARD"), (11.0, 16.0, "0REDUCE_GRAD")]
    assert [(s, e, str(a)) for s, e, a in replayed.compute[0]] == [
        (5, 6, "0F0"), (6, 7, "0BW0"), (16, 20, "0OPTIM")]
    assert replayed.step_time_s == 20


@pytest.mark.parametrize("overrides, message", [
    ({0: {F(1, 0): 1.0}}, "runs no compute action 1F0"),
    ({5: {F(0, 0): 1.0}}, "names device 5"),
    ({0: {F(0, 0): -1.0}}, "below 0"),
])
def test_an_override_the_program_does_not_run_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(uniform_problem(two_stage_gpipe()), duration_overrides=overrides)


def test_a_device_that_starts_late_delays_what_waits_for_it():
    problem = uniform_problem(two_stage_gpipe(), f=1, b=1, w=1)
    result = simulate(dataclasses.replace(problem, start_s={1: 2.5}))
    assert spans(result, 1) == [(2.5, 3.5, "1F0"), (3.5, 4.5, "1F1"), (4.5, 6.5, "1BW0"), (6.5, 8.5, "1BW1")]
    assert spans(result, 0)[2:] == [(6.5, 8.5, "0BW0"), (8.5, 10.5, "0BW1")]
    with pytest.raises(ValueError, match="start_s: device 7"):
        dataclasses.replace(problem, start_s={7: 1.0})
