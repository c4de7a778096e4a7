"""Each device's step splits into compute, bubble, exposed transfer, exposed ZeRO, exposed CLIP and
clipping barrier; the parts sum to the step and each is charged to its cause (medley.sim.result).

The hand-built problems use α = 0 and β = 1 B/s, so a transfer of ``x`` bytes takes ``x`` seconds
and an all-reduce of ``n`` bytes over two devices ``n`` seconds; every time below is exact."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_doubles import AlphaBetaComm

from medley.cost.interfaces import Collective
from medley.schedule.generators import generate
from medley.schedule.ir import Action, F, Kind, PipelineSchedule
from medley.schedule.zero import place_collectives
from medley.schedule.zero_settings import StageZero
from medley.sim import CollectiveCost, DeviceReport, SimProblem, SimResult, StageCost, simulate

PARTS = ("compute", "bubble", "exposed_transfer", "exposed_zero", "exposed_clip", "clip_barrier")


def parts(report: DeviceReport) -> dict[str, float]:
    assert tuple(report.parts) == PARTS
    return {name: seconds for name, seconds in report.parts.items() if seconds}


def two_stage_rows(*, reduce: bool, clip: bool) -> list[list[Action]]:
    """One micro-batch through two stages: F, then BW; stage 1 optionally reduces its gradient
    (stage 0 never does); with ``clip`` both ranks meet at CLIP, then step their optimizer."""
    rows = [[F(0, 0), Action(0, Kind.BW, 0)], [F(1, 0), Action(1, Kind.BW, 0)]]
    if reduce:
        rows[1].append(Action(1, Kind.REDUCE_GRAD))
    if clip:
        rows[0] += [Action(0, Kind.CLIP), Action(0, Kind.OPTIM)]
        rows[1] += [Action(1, Kind.CLIP), Action(1, Kind.OPTIM)]
    return rows


def one_second(devices: int) -> float:
    """Bytes an all-reduce over ``devices`` moves in one second at β = 1 B/s."""
    return devices / (2 * (devices - 1))


def two_stage_problem(*, replicas: int, reduce: bool, clip: bool, slow_stage1: float = 1.0) -> SimProblem:
    """Replica r runs stage s on device 2r + s. F = 1 s, BW = 2 s, a transfer 0.5 s, stage 1's
    REDUCE_GRAD (an all-reduce over the replicas) 1 s, CLIP (over every device) 1 s, OPTIM
    0.5 s. ``slow_stage1`` scales the last replica's stage 1 compute."""
    schedules = [
        PipelineSchedule(family="hand", num_stages=2, num_micro_batches=1, stage_to_rank=(0, 1),
                         actions=two_stage_rows(reduce=reduce, clip=clip))
        for _ in range(replicas)
    ]
    devices = [[2 * r, 2 * r + 1] for r in range(replicas)]
    world = tuple(d for row in devices for d in row)
    base = StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, send_bytes=0.5)
    slow = replace(base, forward_s=slow_stage1, backward_input_s=slow_stage1, backward_weight_s=slow_stage1)
    costs = [[base, base] for _ in range(replicas)]
    costs[-1][1] = slow

    def table(replica: int, action: Action) -> CollectiveCost:
        # an all-reduce of n bytes over d devices takes 2 (d-1)/d n seconds: 1 s for these n
        if action.kind is Kind.REDUCE_GRAD:
            return CollectiveCost(group=tuple(row[1] for row in devices), op=Collective.ALL_REDUCE,
                                  nbytes=one_second(replicas))
        if action.kind is Kind.CLIP:
            return CollectiveCost(group=world, op=Collective.ALL_REDUCE, nbytes=one_second(len(world)))
        assert action.kind is Kind.OPTIM
        return CollectiveCost(group=(devices[replica][action.stage],), op=None, compute_s=0.5)

    return SimProblem(schedules=schedules, devices=devices, stage_costs=costs,
                      comm=AlphaBetaComm(alpha=0.0, beta=1.0), collectives=table)


def test_the_drain_after_a_reduction_is_bubble_and_only_the_reduction_is_exposed_zero():
    """Stage 1: F [1.5, 2.5], BW [2.5, 4.5], its reduction [4.5, 5.5], then idle until stage 0's
    BW [5, 7] ends the step: 1.5 s of drain that the old report called exposed ZeRO."""
    result = simulate(two_stage_problem(replicas=2, reduce=True, clip=False))
    assert result.step_time_s == 7.0
    first, last = result.device(0), result.device(1)
    # head: stage 0's F ends at 1 (bubble), its activation arrives at 1.5 (transfer);
    # tail: the reduction [4.5, 5.5] (ZeRO), then stage 0's backward (bubble)
    assert parts(last) == {"compute": 3.0, "bubble": 1.0 + 1.5, "exposed_transfer": 0.5, "exposed_zero": 1.0}
    # stage 0 waits for stage 1's BW (ends 4.5: bubble) and the gradient (arrives 5: transfer)
    assert parts(first) == {"compute": 3.0, "bubble": 3.5, "exposed_transfer": 0.5}
    assert result.zero == {1: result.zero[1]}
    assert (result.zero[1].comm_s, result.zero[1].exposed_s) == (1.0, 1.0)


def test_waiting_for_a_slower_replica_at_a_reduction_is_bubble():
    """Replica 1's stage 1 computes twice as slowly (F [1.5, 3.5], BW [3.5, 7.5]), so device 1
    issues the reduction at 4.5 but it only runs [7.5, 8.5]; replica 1's stage 0 ends at 10."""
    result = simulate(two_stage_problem(replicas=2, reduce=True, clip=False, slow_stage1=2.0))
    assert result.step_time_s == 10.0
    fast = result.device(1)
    # 1 + 3 (head; waiting for replica 1 to issue) + 1.5 (drain) of bubble; 1 s of ZeRO, not 4
    assert parts(fast) == {"compute": 3.0, "bubble": 1.0 + 3.0 + 1.5, "exposed_transfer": 0.5,
                           "exposed_zero": 1.0}
    slow = result.device(3)
    assert parts(slow) == {"compute": 6.0, "bubble": 1.0 + 1.5, "exposed_transfer": 0.5, "exposed_zero": 1.0}
    assert (result.zero[1].comm_s, result.zero[1].exposed_s) == (1.0, 1.0)


def test_clip_barrier_and_clip_all_reduce_are_their_own_parts():
    """Stage 1 ends its BW at 4.5 and issues CLIP; stage 0 gets there at 7; CLIP runs [7, 8];
    both OPTIMs run [8, 8.5]. Stage 1 waited 2.5 s for the other rank, 1 s for the all-reduce."""
    result = simulate(two_stage_problem(replicas=1, reduce=False, clip=True))
    assert result.step_time_s == 8.5
    assert parts(result.device(1)) == {"compute": 3.5, "bubble": 1.0, "exposed_transfer": 0.5,
                                       "clip_barrier": 2.5, "exposed_clip": 1.0}
    assert parts(result.device(0)) == {"compute": 3.5, "bubble": 3.5, "exposed_transfer": 0.5,
                                       "exposed_clip": 1.0}
    assert result.zero == {}  # CLIP is not a stage's ZeRO communication
    assert result.device(1).exposed_comm_s == 0.5 + 1.0
    assert result.device(1).bubble_fraction == pytest.approx(1.0 / 8.5)


def test_reduction_then_clip_splits_the_wait_before_the_optimizer_step():
    """Two replicas with clipping: device 1 reduces [4.5, 5.5], waits for stage 0 at CLIP until 7,
    CLIP [7, 8], OPTIM [8, 8.5]."""
    result = simulate(two_stage_problem(replicas=2, reduce=True, clip=True))
    assert result.step_time_s == 8.5
    assert parts(result.device(1)) == {"compute": 3.5, "bubble": 1.0, "exposed_transfer": 0.5,
                                       "exposed_zero": 1.0, "clip_barrier": 1.5, "exposed_clip": 1.0}


def test_a_gather_before_the_first_forward_is_exposed_zero():
    """One stage on two replicas, ZeRO-3: the all-gather [0, 5] delays the first F."""
    group = (0, 1)

    def table(replica: int, action: Action) -> CollectiveCost:
        if action.kind is Kind.UNSHARD:
            return CollectiveCost(group=group, op=Collective.ALL_GATHER, nbytes=10.0)
        return CollectiveCost(group=group, op=None)

    row = [Action(0, Kind.UNSHARD), F(0, 0), Action(0, Kind.BW, 0), Action(0, Kind.RESHARD)]
    schedules = [PipelineSchedule(family="one", num_stages=1, num_micro_batches=1, stage_to_rank=(0,),
                                  actions=[row]) for _ in range(2)]
    cost = StageCost(forward_s=1, backward_input_s=1, backward_weight_s=1)
    result = simulate(SimProblem(schedules=schedules, devices=[[0], [1]], stage_costs=[[cost], [cost]],
                                 comm=AlphaBetaComm(alpha=0.0, beta=1.0), collectives=table))
    assert parts(result.device(0)) == {"compute": 3.0, "exposed_zero": 5.0}


def assert_accounting(result: SimResult) -> None:
    """Parts sum to the step; none is negative; exposed ZeRO (CLIP) is within the device's own
    ZeRO (CLIP) collectives' durations; a stage's exposed time within its collective time."""
    for report in result.devices:
        assert sum(report.parts.values()) == pytest.approx(result.step_time_s, abs=1e-9)
        assert all(seconds >= 0.0 for seconds in report.parts.values()), report.parts
        own = [(end - start, action.kind) for members, start, end, action in result.collectives
               if report.device in members]
        zero = sum(length for length, kind in own if kind is not Kind.CLIP)
        clip = sum(length for length, kind in own if kind is Kind.CLIP)
        assert report.exposed_zero_s <= zero + 1e-9
        assert report.exposed_clip_s <= clip + 1e-9
        assert report.idle_s == pytest.approx(result.step_time_s - report.busy_s, abs=1e-9)
    for stage in result.zero.values():
        assert stage.exposed_s <= stage.comm_s + 1e-9


levels = st.builds(StageZero, level=st.integers(0, 3), buckets=st.integers(1, 2),
                   gather_windows=st.integers(0, 1))


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]), p=st.integers(1, 3),
       dp=st.integers(1, 2), extra=st.lists(st.integers(0, 3), min_size=2, max_size=2),
       zero=st.lists(levels, min_size=6, max_size=6), clip=st.booleans(),
       times=st.lists(st.floats(0.1, 3.0), min_size=24, max_size=24),
       alpha=st.floats(0.0, 0.5), beta=st.floats(1.0, 100.0), data=st.data())
def test_parts_sum_to_the_step_on_random_problems(family, p, dp, extra, zero, clip, times, alpha, beta, data):
    knobs = {"virtual_stages": 2} if family == "interleaved" else {}
    counts = [p * (1 + extra[r]) if family == "interleaved" else p + extra[r] for r in range(dp)]
    bases = [generate(family, pp=p, micro_batches=m, **knobs) for m in counts]
    stages = bases[0].num_stages
    zero = zero[:stages]
    policy = data.draw(st.sampled_from(["naive", "bubble"]))
    if len(set(counts)) > 1:
        # ZeRO-3 gathered per micro-batch needs equal micro-batch counts (place_collectives
        # refuses it where a rank holds several stages: it can deadlock)
        zero = [replace(z, gather_windows=max(1, z.gather_windows)) for z in zero]
        policy = "bubble" if family == "interleaved" else policy
    schedules = place_collectives(bases, zero, stage_layers=[2] * stages, clip_grad=clip, policy=policy)
    devices = [[r * p + k for k in range(p)] for r in range(dp)]
    world = tuple(d for row in devices for d in row)
    costs = [[StageCost(forward_s=times[(r * 6 + s) % 24], backward_input_s=times[(r * 6 + s + 7) % 24],
                        backward_weight_s=times[(r * 6 + s + 13) % 24], send_bytes=times[s] * 10)
              for s in range(stages)] for r in range(dp)]

    def table(replica: int, action: Action) -> CollectiveCost:
        if action.kind is Kind.CLIP:
            return CollectiveCost(group=world, op=Collective.ALL_REDUCE, nbytes=8.0)
        rank = schedules[replica].stage_to_rank[action.stage]
        group = tuple(row[rank] for row in devices)
        if action.kind is Kind.OPTIM:
            return CollectiveCost(group=group, op=None, compute_s=0.3)
        if action.kind is Kind.RESHARD:
            return CollectiveCost(group=group, op=None)
        op = Collective.ALL_GATHER if action.kind is Kind.UNSHARD else Collective.REDUCE_SCATTER
        return CollectiveCost(group=group, op=op, nbytes=50.0)

    problem = SimProblem(schedules=schedules, devices=devices, stage_costs=costs,
                         comm=AlphaBetaComm(alpha=alpha, beta=beta), collectives=table)
    assert_accounting(simulate(problem))


def test_a_compiled_clipped_plan_on_mixed_gpus_keeps_the_accounting():
    """A planner-compiled 1F1B plan (pp=4, dp=2, ZeRO 1,2,3,0, clipping, A100 + V100): the parts
    add up, and the last stages, which finish their backward first, wait at the CLIP barrier."""
    from medley.cost.estimator import CatalogCostSource
    from medley.lowering.compile import compile_problem
    from medley.plan.inline import inline_layout
    from medley.spec.cluster_load import parse_cluster_arg
    from medley.spec.model_arg import get_model

    cluster = parse_cluster_arg("4xA100-80GB+4xV100-32GB")
    model = get_model("llama-2-7b")
    cost = CatalogCostSource.for_cluster(model, cluster)
    layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=4, dp=2, schedule="1f1b",
                           micro_batches="8,6", micro_batch_size=1, seq_len=1024, zero="1,2,3,0")
    result = simulate(compile_problem(replace(layout, clip_grad=True), cluster, cost))
    assert_accounting(result)
    assert any(report.clip_barrier_s > 0 for report in result.devices)
