"""The world-order check (:func:`medley.schedule.world_order.check_world_order`): programs whose
collectives meet in unlike orders are found to hang, and walking one stand-in per kin and program
gives the same verdict as walking every replica."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medley.schedule.ir import Action, Kind, PipelineSchedule
from medley.schedule.world_order import WorldOrderError, check_world_order

BUCKETS = 3


def program(order: list[int]) -> PipelineSchedule:
    """One rank, one micro-batch, then a gradient reduction per bucket in ``order``."""
    row = [Action(0, Kind.F, 0), Action(0, Kind.BW, 0),
           *(Action(0, Kind.REDUCE_GRAD, bucket=b) for b in order)]
    return PipelineSchedule(family="test", num_stages=1, num_micro_batches=1, stage_to_rank=(0,),
                            actions=[row])


def everyone(count: int, calls: list[int] | None = None):  # noqa: ANN201 - a CollectiveKey
    """Every reduction waits for all ``count`` replicas; ``calls`` collects the replicas asked for."""
    def key(replica: int, action: Action):  # noqa: ANN202
        if calls is not None:
            calls.append(replica)
        if action.kind is not Kind.REDUCE_GRAD:
            return None
        return tuple((r, 0) for r in range(count)), (action.kind, action.bucket)
    return key


def hangs(schedules: list[PipelineSchedule], **kw: object) -> bool:
    try:
        check_world_order(schedules, everyone(len(schedules)), **kw)
    except WorldOrderError:
        return True
    return False


def test_unlike_orders_hang_and_the_error_names_the_stand_ins() -> None:
    a, b = program([0, 1, 2]), program([1, 0, 2])
    schedules = [a, a, b, b]
    calls: list[int] = []
    with pytest.raises(WorldOrderError, match="replica 0 pipeline rank 0 at 0REDUCE_GRAD"):
        check_world_order(schedules, everyone(4, calls), kin=lambda replica: replica // 2)
    assert set(calls) == {0, 2}  # replicas 1 and 3 run their kin's program: never walked
    assert hangs(schedules)
    assert not hangs([a, a, program([0, 1, 2]), a])


@settings(max_examples=60, deadline=None)
@given(orders=st.lists(st.permutations(range(BUCKETS)), min_size=1, max_size=3),
       picks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1)), min_size=2, max_size=6))
def test_stand_ins_give_every_replicas_verdict(orders: list[list[int]], picks: list[tuple[int, int]]) -> None:
    """Replicas of two kins, each running one of a few shared programs: the verdict walking one
    stand-in per (kin, program) equals the one walking all of them."""
    shared = [program(order) for order in orders]
    schedules = [shared[p % len(shared)] for p, _ in picks]
    kins = [k for _, k in picks]
    assert hangs(schedules, kin=kins.__getitem__) == hangs(schedules)
