"""NCCL's rules on the lowered programs: each rank pair receives in the order it sends, and the
program runs to its end when every batch of transfers waits for the other ends of its messages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_generators import family_case

from medley.schedule.generators import generate
from medley.schedule.ir import P2P_KINDS, Action, Kind, PipelineSchedule, add_send_recv
from medley.schedule.messages import message_key, pair_order_error, transfer_runs
from medley.schedule.validate import ScheduleError, check_rules, validate
from medley.schedule.world_order import check_world_order


def _pairs(lowered: PipelineSchedule) -> dict[tuple[int, int], tuple[list, list]]:
    """Per ordered rank pair: (messages in send order, messages in receive order)."""
    s2r = lowered.stage_to_rank
    pairs: dict[tuple[int, int], tuple[list, list]] = {}
    for row in lowered.actions:
        for action in row:
            if action.kind not in P2P_KINDS:
                continue
            key = message_key(action)
            src, dst = s2r[key[1]], s2r[key[2]]
            sends, receives = pairs.setdefault((src, dst), ([], []))
            (sends if action.kind in (Kind.SEND_F, Kind.SEND_B) else receives).append(key)
    return pairs


def test_interleaved_pp2_five_micro_batches_swapped_messages_before_and_not_now(former_lowering) -> None:
    schedule = generate("interleaved", pp=2, micro_batches=5, virtual_stages=2)
    before = former_lowering(schedule)
    sends, receives = _pairs(before)[(0, 1)]
    assert sends != receives  # on NCCL a gradient would have filled an activation's buffer
    error = pair_order_error(before)
    assert error is not None and error.startswith("rank 1, action 1RECV_F3")
    assert "send 7 of rank 0 to rank 1 is the gradient of micro-batch 0 from stage 2 to stage 1" in error
    with pytest.raises(ScheduleError):  # it also hangs when sends wait for their receives
        check_rules(before)
    now = add_send_recv(schedule)
    assert all(sends == receives for sends, receives in _pairs(now).values())
    validate(now)


def test_one_f_one_b_receives_right_before_use_in_one_batch_with_the_sends(former_lowering) -> None:
    """1F1B keeps the lowering it always had: each RECV right before its consumer, in one batch
    with the sends of the action before (send forward, receive backward: Megatron's pairing)."""
    lowered = add_send_recv(generate("1f1b", pp=2, micro_batches=4))
    assert lowered == former_lowering(generate("1f1b", pp=2, micro_batches=4))
    row = lowered.actions[0]
    assert [tuple(map(str, row[a:b])) for a, b in transfer_runs(row)][:2] == [
        ("0SEND_F0",), ("0SEND_F1", "0RECV_B0")]


def test_sends_that_wait_for_their_receives_deadlock_one_f_one_b_without_batches() -> None:
    """The rendezvous rule is real: 1F1B with a collective between the send of one micro-batch and
    the receive of the next gradient (no batch can pair them) hangs on NCCL, and the validator
    says so."""
    lowered = add_send_recv(generate("1f1b", pp=2, micro_batches=4))
    rows = []
    for row in lowered.actions:
        out = []
        for action in row:
            sent_last = out and out[-1].kind in (Kind.SEND_F, Kind.SEND_B)
            if action.kind in (Kind.RECV_B, Kind.RECV_F) and sent_last:
                out.append(Action(action.stage, Kind.RESHARD))  # splits the batch
            out.append(action)
        rows.append(out)
    with pytest.raises(ScheduleError, match="deadlock.*each send waits for its receive"):
        check_rules(lowered.with_actions(rows))


@st.composite
def lowered_case(draw: st.DrawFn) -> PipelineSchedule:
    family, pp, m, knobs = draw(family_case())
    return add_send_recv(generate(family, pp=pp, micro_batches=m, **knobs))


@settings(max_examples=200, deadline=None)
@given(lowered_case())
def test_every_family_receives_in_send_order_and_runs_with_rendezvous_sends(
        lowered: PipelineSchedule) -> None:
    """Every family (interleaved of 1-4 chunks, hetero-1F1B depths, zero-bubble, bidirectional),
    pp 1-8, 1-24 micro-batches: per rank pair the same messages in the same order at both ends,
    each RECV before its consumer, and the strict execution (validate's rules one by one, not
    the fast proof) ends."""
    assert pair_order_error(lowered) is None
    assert all(sends == receives for sends, receives in _pairs(lowered).values())
    check_rules(lowered)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 4), st.integers(1, 7),
                          st.sampled_from(["1f1b", "zb-h1", "interleaved"])), min_size=2, max_size=3))
def test_replicas_of_unlike_shapes_run_together(shapes: list[tuple[int, int, str]]) -> None:
    """Asymmetric worlds: replicas of other depths, counts and families, each lowered for NCCL,
    run together when a world-wide collective (the CLIP all-reduce) ends each program."""
    schedules = []
    for pp, m, family in shapes:
        knobs = {"virtual_stages": 2} if family == "interleaved" else {}
        lowered = add_send_recv(generate(family, pp=pp, micro_batches=m, **knobs))
        schedules.append(lowered.with_actions([row + [Action(0 if not row else row[0].stage, Kind.CLIP)]
                                               for row in lowered.actions]))
    members = tuple((r, k) for r, s in enumerate(schedules) for k in range(s.num_ranks))

    def key(replica: int, action: Action):
        return (members, "clip") if action.kind is Kind.CLIP else None

    check_world_order(schedules, key)
