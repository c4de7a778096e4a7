"""Two-direction schedules: up micro-batches enter at stage p, so the chain ends differ."""

from hypothesis import given, settings
from hypothesis import strategies as st

from medley.schedule.generators import generate
from medley.sim.engine import simulate
from medley.sim.problem import SimProblem, StageCost

UNIT = StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 10), st.data())
def test_every_micro_batch_of_both_directions_runs(pp: int, micro_batches: int, data) -> None:
    down = data.draw(st.integers(0, micro_batches))
    schedule = generate("bidirectional", pp=pp, micro_batches=micro_batches, down_micro_batches=down)
    problem = SimProblem(schedules=[schedule], devices=[list(range(pp))], stage_costs=[[UNIT] * (2 * pp)])
    result = simulate(problem)
    ran = sum(len(spans) for spans in result.compute.values())
    assert ran == sum(1 for row in schedule.actions for a in row if a.is_compute)
    # No device can beat its own work, and the longest chain bounds the step from below.
    work = max(sum(end - start for start, end, _ in spans) for spans in result.compute.values())
    assert result.step_time_s >= max(work, 2.0 * pp + 1.0) - 1e-9
