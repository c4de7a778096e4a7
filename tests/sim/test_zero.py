"""ZeRO collectives in the simulator: group rendezvous, waits, memory and the per-stage report."""

from __future__ import annotations

import pytest
from sim_doubles import AlphaBetaComm

from medley.cost.interfaces import Collective
from medley.schedule.ir import Action, F, Kind, PipelineSchedule
from medley.sim import CollectiveCost, SimProblem, StageCost, simulate


def zero3_program() -> list[Action]:
    return [Action(0, Kind.UNSHARD), F(0, 0), Action(0, Kind.BW, 0), Action(0, Kind.RESHARD),
            Action(0, Kind.REDUCE_GRAD), Action(0, Kind.OPTIM)]


def zero3_table(replica: int, action: Action) -> CollectiveCost:
    group = (0, 1)
    if action.kind is Kind.UNSHARD:
        return CollectiveCost(group=group, op=Collective.ALL_GATHER, nbytes=10.0, alloc_bytes=10.0)
    if action.kind is Kind.RESHARD:
        return CollectiveCost(group=group, op=None, free_bytes=10.0)
    if action.kind is Kind.REDUCE_GRAD:
        return CollectiveCost(group=group, op=Collective.REDUCE_SCATTER, nbytes=10.0, free_bytes=10.0)
    return CollectiveCost(group=group, op=None, compute_s=1.0)


def zero3_problem(table=zero3_table, rows=None) -> SimProblem:
    """Two replicas of a one-stage pipeline; replica 1 computes twice as slowly."""
    rows = rows or [zero3_program(), zero3_program()]
    schedules = [PipelineSchedule(family="one", num_stages=1, num_micro_batches=1, stage_to_rank=(0,),
                                  actions=[row]) for row in rows]
    fast = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1, grad_buffer_bytes=10.0)
    slow = StageCost(forward_s=2, backward_input_s=2, backward_weight_s=2, grad_buffer_bytes=10.0)
    return SimProblem(schedules=schedules, devices=[[0], [1]], stage_costs=[[fast], [slow]],
                      static_memory_bytes={0: 5.0, 1: 5.0}, comm=AlphaBetaComm(alpha=0.0, beta=1.0),
                      collectives=table)


def test_collectives_wait_for_every_member_and_compute_waits_for_them():
    result = simulate(zero3_problem())
    # all-gather of 10 bytes over 2 devices at 1 B/s moves 5 bytes: 5 s; so does the reduce-scatter.
    assert [(c[0], c[1], c[2], str(c[3])) for c in result.collectives] == [
        ((0, 1), 0.0, 5.0, "0UNSHARD"), ((0, 1), 11.0, 16.0, "0REDUCE_GRAD")]
    def spans(device):
        return [(s, e, str(a)) for s, e, a in result.compute[device]]

    assert spans(0) == [(5, 6, "0F0"), (6, 8, "0BW0"), (16, 17, "0OPTIM")]
    assert spans(1) == [(5, 7, "0F0"), (7, 11, "0BW0"), (16, 17, "0OPTIM")]
    assert result.step_time_s == 17


def test_exposed_zero_communication_per_device_and_stage():
    result = simulate(zero3_problem())
    fast, slow = result.devices
    # The fast replica waits 5 s for the gather, 3 s (8..11) for the slow replica to issue the
    # reduce-scatter (bubble: another device is late, no collective runs), then 5 s for it.
    assert (fast.exposed_zero_s, fast.bubble_s) == (5 + 5, 3)
    assert (slow.exposed_zero_s, slow.bubble_s) == (5 + 5, 0)
    assert fast.bubble_fraction == pytest.approx(3 / 17)
    assert result.zero[0].comm_s == pytest.approx(10.0)
    assert result.zero[0].exposed_s == pytest.approx(10.0)


def test_gathered_weights_and_gradient_buffer_memory():
    result = simulate(zero3_problem())
    # static 5; +10 gathered at 0; +10 full gradients at the BW start (6); -10 at RESHARD (8); -10 after
    # the reduce-scatter (16)
    assert result.memory[0] == ([0.0, 6.0, 8.0, 16.0], [15.0, 25.0, 15.0, 5.0])
    assert result.device(0).peak_memory_bytes == 25.0


def test_a_member_that_skips_a_collective_is_reported():
    short = [a for a in zero3_program() if a.kind is not Kind.REDUCE_GRAD]
    message = r"0REDUCE_GRAD over devices \[0, 1\] is never issued by devices \[1\]"
    with pytest.raises(ValueError, match=message):
        simulate(zero3_problem(rows=[zero3_program(), short]))


def test_collective_group_must_contain_the_issuing_device():
    def table(replica: int, action: Action) -> CollectiveCost:
        return CollectiveCost(group=(0,), op=Collective.ALL_GATHER, nbytes=1.0)

    with pytest.raises(ValueError, match="lacks the issuing device 1"):
        simulate(zero3_problem(table=table))


def test_collective_group_must_name_simulated_devices():
    def table(replica: int, action: Action) -> CollectiveCost:
        return CollectiveCost(group=(0, 1, 2), op=Collective.ALL_GATHER, nbytes=1.0)

    with pytest.raises(ValueError, match=r"names devices \[2\] that run no rank"):
        simulate(zero3_problem(table=table))


def test_no_comm_makes_collectives_free_but_keeps_the_optimizer_step():
    problem = zero3_problem()
    problem.comm = None
    result = simulate(problem)
    assert result.step_time_s == 6 + 1  # slow replica's compute, then the optimizer step
    assert result.zero[0].comm_s == 0.0


def test_gradient_buffer_is_allocated_again_after_each_reduction():
    """Two reduce-scatter rounds in one step: the full gradient is allocated again by the second
    BW, which overlaps the first reduce-scatter, so both buffers live for that second."""
    group = (0, 1)
    row = [F(0, 0), F(0, 1), Action(0, Kind.BW, 0), Action(0, Kind.REDUCE_GRAD), Action(0, Kind.BW, 1),
           Action(0, Kind.REDUCE_GRAD)]

    def table(replica: int, action: Action) -> CollectiveCost:
        return CollectiveCost(group=group, op=Collective.REDUCE_SCATTER, nbytes=2.0, free_bytes=10.0)

    schedules = [PipelineSchedule(family="one", num_stages=1, num_micro_batches=2, stage_to_rank=(0,),
                                  actions=[row]) for _ in range(2)]
    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1, grad_buffer_bytes=10.0)
    result = simulate(SimProblem(schedules=schedules, devices=[[0], [1]], stage_costs=[[cost], [cost]],
                                 comm=AlphaBetaComm(alpha=0.0, beta=1.0), collectives=table))
    # BW0 [2, 4], reduce-scatter [4, 5]; BW1 [4, 6], reduce-scatter [6, 7]
    assert result.memory[0] == ([0.0, 2.0, 4.0, 5.0, 7.0], [0.0, 10.0, 20.0, 10.0, 0.0])


def test_placement_pass_output_runs_with_uneven_micro_batches():
    """The ZeRO pass's programs (levels 3 and 1, bubble policy) for replicas with 4 and 6
    micro-batches simulate without deadlock, and each collective ran on both replicas' devices."""
    from medley.schedule.generators import generate
    from medley.schedule.zero import place_collectives
    from medley.schedule.zero_settings import StageZero

    zero = [StageZero(level=3, buckets=2), StageZero(level=1, buckets=2)]
    schedules = place_collectives([generate("1f1b", pp=2, micro_batches=m) for m in (4, 6)], zero,
                                  stage_layers=[4, 4], policy="bubble")
    devices = [[0, 1], [2, 3]]

    def table(replica: int, action: Action) -> CollectiveCost:
        rank = schedules[replica].stage_to_rank[action.stage]
        group = (devices[0][rank], devices[1][rank])
        level = zero[action.stage].level
        if action.kind is Kind.OPTIM:
            return CollectiveCost(group=group, op=None, compute_s=0.5)
        if action.kind is Kind.RESHARD:
            return CollectiveCost(group=group, op=None, free_bytes=25.0)
        if action.kind is Kind.UNSHARD:
            return CollectiveCost(group=group, op=Collective.ALL_GATHER, nbytes=50.0,
                                  alloc_bytes=25.0 if level == 3 else 0.0)
        return CollectiveCost(group=group, op=Collective.REDUCE_SCATTER, nbytes=50.0)

    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1, activation_bytes=1.0,
                     send_bytes=8.0)
    problem = SimProblem(schedules=schedules, devices=devices, stage_costs=[[cost, cost]] * 2,
                         static_memory_bytes={d: 100.0 for d in range(4)},
                         comm=AlphaBetaComm(alpha=0.1, beta=100.0), collectives=table)
    result = simulate(problem)
    assert result.collectives and all(len(members) == 2 for members, *_ in result.collectives)
    assert set(result.zero) == {0, 1}
    for report in result.devices:
        assert min(result.memory[report.device][1]) >= 100.0
        assert report.exposed_zero_s <= report.idle_s + 1e-9
    assert result.step_time_s >= 6 * 3 + 3  # the 6-micro-batch replica's compute alone


@pytest.mark.parametrize(
    ("activations", "workspace", "gradient", "peak"),
    [(8.0, 0.0, 3.0, 8.0), (3.0, 0.0, 8.0, 8.0), (8.0, 2.0, 3.0, 10.0), (3.0, 2.0, 8.0, 8.0)],
)
def test_the_first_backward_holds_the_larger_of_its_activations_and_its_gradient(
    activations: float, workspace: float, gradient: float, peak: float
) -> None:
    """The gradient grows as the backward frees the activations and its workspace: none before
    the first backward, then the whole gradient until the step ends (no reduction here); the
    backward's peak is the larger of the two ends, never their sum."""
    row = [F(0, 0), Action(0, Kind.BW, 0)]
    schedule = PipelineSchedule(family="one", num_stages=1, num_micro_batches=1, stage_to_rank=(0,),
                                actions=[row])
    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1, activation_bytes=activations,
                     grad_buffer_bytes=gradient, workspace_bytes=workspace)
    result = simulate(SimProblem(schedules=[schedule], devices=[[0]], stage_costs=[[cost]],
                                 static_memory_bytes={0: 1.0}))
    # F [0, 1] allocates the activations; BW [1, 3]; the gradient stays after it.
    assert result.device(0).peak_memory_bytes == 1.0 + peak
    assert result.memory[0][1][-1] == 1.0 + gradient
