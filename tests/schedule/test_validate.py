"""Bad schedules are rejected with a message naming the rank, the action and the rule."""

from __future__ import annotations

import random

import pytest

from medley.schedule.generators import generate
from medley.schedule.ir import (
    BW,
    Action,
    F,
    Kind,
    PipelineSchedule,
    add_send_recv,
    loop_stage_to_rank,
    parse_rows,
)
from medley.schedule.validate import (
    ScheduleError,
    check_rules,
    in_flight_profile,
    peak_in_flight,
    validate,
)
from medley.schedule.validate_fast import runs_cleanly


def schedule_of(rows: list[str], m: int, *, stage_to_rank: tuple[int, ...] | None = None) -> PipelineSchedule:
    actions = parse_rows(rows)
    s2r = stage_to_rank or loop_stage_to_rank(len(rows))
    return PipelineSchedule(family="test", num_stages=len(s2r), num_micro_batches=m, stage_to_rank=s2r,
                            actions=actions)


def test_backward_before_forward() -> None:
    bad = schedule_of(["0F0,0BW0", "1BW0,1F0"], 1)
    with pytest.raises(ScheduleError, match=r"rank 1, action 1BW0 \(position 0\): backward before its F"):
        validate(bad)


def test_w_before_b_and_mixed_backward() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0, action 0W0 .*W before its B"):
        validate(schedule_of(["0F0,0W0,0B0"], 1))
    with pytest.raises(ScheduleError, match=r"rank 0, action 0B0 .*either one BW or one B then one W"):
        validate(schedule_of(["0F0,0BW0,0B0,0W0"], 1))


def test_duplicate_missing_and_misplaced_actions() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0, action 0F0 \(position 1\): .*exactly one F"):
        validate(schedule_of(["0F0,0F0,0BW0"], 1))
    with pytest.raises(ScheduleError, match=r"rank 1, action 1BW1: missing"):
        validate(schedule_of(["0F0,0F1,0BW0,0BW1", "1F0,1F1,1BW0"], 2))
    with pytest.raises(ScheduleError, match=r"rank 0, action 1F0 .*belongs on rank 1"):
        validate(schedule_of(["0F0,1F0,1BW0,0BW0", ""], 1))
    with pytest.raises(ScheduleError, match=r"micro-batch 3 does not exist"):
        validate(schedule_of(["0F3,0BW3"], 1))


def test_unmatched_send() -> None:
    lowered = add_send_recv(generate("1f1b", pp=2, micro_batches=2))
    rows = [list(r) for r in lowered.actions]
    rows[1].remove(Action(1, Kind.RECV_F, 1))
    with pytest.raises(ScheduleError, match=r"rank 0, action 0SEND_F1: unmatched: rank 1 has no 1RECV_F1"):
        validate(lowered.with_actions(rows))


def test_receive_after_its_consumer() -> None:
    lowered = add_send_recv(generate("gpipe", pp=2, micro_batches=1))
    rows = [list(r) for r in lowered.actions]
    rows[1] = [a for a in rows[1] if a.kind is not Kind.RECV_F]
    rows[1].insert(1, Action(1, Kind.RECV_F, 0))
    with pytest.raises(ScheduleError, match=r"rank 1, action 1F0 \(position 0\): needs data from another"):
        validate(lowered.with_actions(rows))


def test_deadlocking_order_names_stuck_ranks() -> None:
    # torch_runtime_scripts/custom_schedule.py's DEADLOCK case, with fused backwards.
    bad = schedule_of(
        ["0F0,0BW0,0F1,0BW1", "1F0,1F1,1BW0,1BW1", "2F0,2F1,2BW0,2BW1", "3F1,3F0,3BW0,3BW1"], 2
    )
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(bad)
    message = str(info.value)
    # Rank 0's batch (its send of micro-batch 0 and its receive of the gradient) waits for the
    # gradient's send on rank 1; rank 3 receives micro-batch 1 first, which rank 2 sends second.
    assert "rank 0 at 0SEND_F0" in message and "rank 1 to reach 1SEND_B0" in message
    assert "rank 3 at 3RECV_F1" in message and "rank 2 to reach 2SEND_F1" in message


def test_compute_only_deadlock_on_one_rank() -> None:
    # Two stages on one rank: the forward of stage 1 cannot run before stage 0's.
    bad = schedule_of(["1F0,0F0,1BW0,0BW0"], 1, stage_to_rank=(0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0, action 1F0: deadlock.*waits for 0F0"):
        validate(bad)


def test_memory_over_limit() -> None:
    gpipe = generate("gpipe", pp=2, micro_batches=4)
    validate(gpipe, activation_limit=[4, 4])
    with pytest.raises(ScheduleError, match=r"rank 0, action 0F3 \(position 3\): activation memory 4 "):
        validate(gpipe, activation_limit=[3, 4])


def test_split_backward_memory_fraction() -> None:
    zb = schedule_of(["0F0,0B0,0F1,0B1,0W0,0W1"], 2)
    assert peak_in_flight(zb) == [2]
    assert max(in_flight_profile(zb, w_fraction=0.25)[0]) == pytest.approx(1.25)
    validate(zb, activation_limit=[1.25], w_fraction=0.25)
    with pytest.raises(ScheduleError, match="exceeds the limit"):
        validate(zb, activation_limit=[1.5])


def test_collectives_are_skipped_and_lowered_schedules_accepted() -> None:
    lowered = add_send_recv(generate("interleaved", pp=2, micro_batches=4, virtual_stages=2))
    rows = [[Action(r, Kind.UNSHARD), *row, Action(r, Kind.REDUCE_GRAD), Action(r, Kind.OPTIM)]
            for r, row in enumerate(lowered.actions)]
    validate(lowered.with_actions(rows))


def test_valid_hand_written_schedule() -> None:
    rows = [[F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)], [F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)]]
    schedule = PipelineSchedule(
        family="x", num_stages=2, num_micro_batches=2, stage_to_rank=(0, 1), actions=rows
    )
    validate(schedule)


def _mutations(schedule: PipelineSchedule, rng: random.Random) -> list[PipelineSchedule]:
    """The schedule, and copies with two actions of a row swapped, one dropped, one doubled, or one
    moved to another rank: most break a rule, some (a swap of independent actions) do not."""
    out = [schedule]
    for _ in range(12):
        rows = [list(r) for r in schedule.actions]
        rank = rng.randrange(len(rows))
        row = rows[rank]
        if len(row) < 2:
            continue
        i, j = sorted(rng.sample(range(len(row)), 2))
        what = rng.randrange(4)
        if what == 0:
            row[i], row[j] = row[j], row[i]
        elif what == 1:
            del row[i]
        elif what == 2:
            row.insert(j, row[i])
        else:
            rows[(rank + 1) % len(rows)].insert(0, row.pop(i))
        out.append(schedule.with_actions(rows))
    return out


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "interleaved", "zb-h1", "hetero-1f1b"])
def test_fast_proof_agrees_with_the_rules(family: str) -> None:
    """validate's integer-indexed proof (runs_cleanly) accepts every generated schedule and never
    accepts one that a rule, checked action by action, rejects."""
    rng = random.Random(family)
    accepted = rejected = 0
    for pp, m in ((1, 3), (2, 2), (2, 5), (3, 7), (4, 8)):
        knobs = {"virtual_stages": 2} if family == "interleaved" else {}
        if family == "interleaved" and m % pp:
            continue
        generated = generate(family, pp=pp, micro_batches=m, **knobs)
        assert runs_cleanly(generated)
        for schedule in _mutations(generated, rng):
            try:
                check_rules(schedule)
                ok = True
            except ScheduleError:
                ok = False
            fast = runs_cleanly(schedule)
            assert not fast or ok, schedule.to_text()
            accepted += fast
            rejected += not ok
    assert accepted and rejected
