"""Hand-built schedules whose timings, bubbles and memory are worked out by hand."""

from __future__ import annotations

from fractions import Fraction

import pytest
from sim_doubles import AlphaBetaComm, uniform_problem

from medley.schedule.ir import BW, B, F, PipelineSchedule, W, add_send_recv
from medley.sim import SimProblem, SimulationError, StageCost, simulate


def two_stage_gpipe(m: int = 2) -> PipelineSchedule:
    rows = [[F(s, i) for i in range(m)] + [BW(s, i) for i in range(m)] for s in range(2)]
    return PipelineSchedule(family="gpipe", num_stages=2, num_micro_batches=m, stage_to_rank=(0, 1),
                            actions=rows)


def spans(result, device):
    return [(start, end, str(action)) for start, end, action in result.compute[device]]


def test_gpipe_two_stages_two_micro_batches_forward_1_backward_2():
    result = simulate(uniform_problem(two_stage_gpipe(), f=1, b=1, w=1))
    assert result.step_time_s == 9
    assert spans(result, 0) == [(0, 1, "0F0"), (1, 2, "0F1"), (5, 7, "0BW0"), (7, 9, "0BW1")]
    assert spans(result, 1) == [(1, 2, "1F0"), (2, 3, "1F1"), (3, 5, "1BW0"), (5, 7, "1BW1")]
    first, second = result.devices
    assert (first.busy_s, first.head_idle_s, first.interior_idle_s, first.tail_idle_s) == (6, 0, 3, 0)
    assert (second.busy_s, second.head_idle_s, second.interior_idle_s, second.tail_idle_s) == (6, 1, 0, 2)
    assert first.bubble_fraction == second.bubble_fraction == pytest.approx(1 / 3)
    assert result.bubble_fraction == pytest.approx(1 / 3)


def test_transfer_takes_alpha_plus_bytes_over_beta_and_is_exposed_on_the_receiver():
    schedule = two_stage_gpipe(m=1)
    comm = AlphaBetaComm(alpha=0.5, beta=100.0)
    result = simulate(uniform_problem(schedule, f=1, b=1, w=1, send_bytes=100.0, comm=comm))
    assert spans(result, 1) == [(2.5, 3.5, "1F0"), (3.5, 5.5, "1BW0")]
    assert spans(result, 0) == [(0, 1, "0F0"), (7, 9, "0BW0")]
    assert [(t[0], t[1], t[2], t[3]) for t in result.transfers] == [(0, 1, 1, 2.5), (1, 0, 5.5, 7)]
    assert ("p2p", 0, 1, 100.0) in comm.calls
    for report in result.devices:
        assert report.exposed_transfer_s == pytest.approx(1.5)
        assert report.bubble_fraction == pytest.approx((6 - 1.5) / 9)


@pytest.mark.parametrize("shared, step", [(None, 9.0), ("spine", 10.5)])
def test_transfers_on_a_shared_link_serialise(shared, step):
    schedule = two_stage_gpipe(m=1)
    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1, send_bytes=100.0)
    problem = SimProblem(
        schedules=[schedule, schedule], devices=[[0, 1], [2, 3]], stage_costs=[[cost, cost]] * 2,
        comm=AlphaBetaComm(alpha=0.5, beta=100.0, shared_link=shared),
    )
    result = simulate(problem)
    assert result.step_time_s == step
    forward_arrivals = sorted(t[3] for t in result.transfers if t[5] == "SEND_F")
    assert forward_arrivals == ([2.5, 2.5] if shared is None else [2.5, 4.0])


def test_lowered_schedule_runs_like_the_compute_only_one():
    from medley.schedule.generators import generate

    schedule = generate("1f1b", pp=4, micro_batches=8)
    comm = AlphaBetaComm(alpha=0.1, beta=50.0)
    costs = dict(f=1, b=1.5, w=0.5, send_bytes=20.0, comm=comm)
    plain = simulate(uniform_problem(schedule, **costs))
    lowered = simulate(uniform_problem(add_send_recv(schedule), **costs))
    assert plain.step_time_s == lowered.step_time_s
    assert plain.compute == lowered.compute
    assert plain.transfers == lowered.transfers


def test_activation_and_gradient_buffer_memory_of_split_backward():
    schedule = PipelineSchedule(family="one", num_stages=1, num_micro_batches=1, stage_to_rank=(0,),
                                actions=[[F(0, 0), B(0, 0), W(0, 0)]])
    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1, activation_bytes=4.0,
                     activation_after_b_bytes=1.0, grad_buffer_bytes=2.0)
    result = simulate(SimProblem(schedules=[schedule], devices=[[7]], stage_costs=[[cost]],
                                 static_memory_bytes={7: 100.0}))
    # B ends at 2 freeing 3 of the 4; W makes the 2-byte gradient while it frees the last 1: it
    # starts holding 2 (the gradient's excess, 1, booked at its start) and frees nothing more.
    assert result.memory[7] == ([0.0, 2.0], [104.0, 102.0])
    assert result.device(7).peak_memory_bytes == 104.0


def test_mfu_and_tokens_per_second():
    problem = uniform_problem(two_stage_gpipe(), f=1, b=1, w=1, tokens_per_step=900.0,
                              model_flops_per_step=9e12, peak_flops={0: 1e12, 1: 1e12})
    result = simulate(problem)
    assert result.tokens_per_s == pytest.approx(100.0)
    assert result.mfu == pytest.approx(0.5)


def test_backward_before_its_forward_is_an_error_naming_the_rank():
    schedule = PipelineSchedule(family="bad", num_stages=1, num_micro_batches=1, stage_to_rank=(0,),
                                actions=[[BW(0, 0), F(0, 0)]])
    with pytest.raises(SimulationError, match=r"device 0 \(replica 0, rank 0\) reaches 0BW0"):
        simulate(uniform_problem(schedule))


def test_missing_backward_deadlocks_with_a_clear_message():
    schedule = PipelineSchedule(family="bad", num_stages=2, num_micro_batches=1, stage_to_rank=(0, 1),
                                actions=[[F(0, 0), BW(0, 0)], [F(1, 0)]])
    with pytest.raises(SimulationError, match="(?s)deadlock.*device 0 .*0BW0"):
        simulate(uniform_problem(schedule))


def test_exact_fractions_hold_for_integer_durations():
    result = simulate(uniform_problem(two_stage_gpipe(m=3), f=2, b=1, w=2))
    report = result.devices[0]
    assert Fraction(report.idle_s) / Fraction(result.step_time_s) == Fraction(1, 4)


def test_executed_ops_count_compute_and_sends_but_not_receives():
    """The engine runs each compute action and each send (lowered or implied after its producer);
    receives are posted early, never executed, so a lowered schedule reports the same count."""
    from medley.schedule.generators import generate
    from medley.schedule.ir import Kind

    schedule = generate("1f1b", pp=3, micro_batches=4)
    lowered = add_send_recv(schedule)
    kinds = [a.kind for row in lowered.actions for a in row]
    sends = kinds.count(Kind.SEND_F) + kinds.count(Kind.SEND_B)
    assert kinds.count(Kind.RECV_F) + kinds.count(Kind.RECV_B) == sends > 0
    compute = sum(len(row) for row in schedule.actions)
    assert simulate(uniform_problem(schedule)).executed_ops == compute + sends
    assert simulate(uniform_problem(lowered)).executed_ops == compute + sends
