"""The release of pipeline sends: never a wait that could block, and few sends left alive.

The programs of every rank are replayed with the runtime's semantics (sends posted without
blocking, receives blocking until their message was posted), in every interleaving a round-robin
over ready ranks produces; each wait the release rule issues must find its message already
received, and the last stage must hold at most a couple of sent gradients at any time.
"""

from __future__ import annotations

import pytest

from medley.runtime.sends import PendingSends, message_key, message_positions
from medley.schedule.generators import generate
from medley.schedule.ir import Action, Kind, PipelineSchedule, add_send_recv


class _Work:
    """A posted send; its wait is legal only once the receiver took the message."""

    def __init__(self, key: tuple, received: set) -> None:
        self.key, self.received = key, received

    def wait(self) -> None:
        assert self.key in self.received, f"wait on {self.key} before its receive: could block"


def _replay(schedule: PipelineSchedule, *, order: int) -> list[int]:
    """Run all programs to the end; returns each rank's most sends alive at once."""
    rows = schedule.actions
    pending = [PendingSends(schedule=schedule) for _ in rows]
    position, posted, received = [0] * len(rows), set(), set()
    most = [0] * len(rows)
    while any(p < len(row) for p, row in zip(position, rows, strict=True)):
        moved = False
        ranks = list(range(len(rows)))
        for rank in ranks[order % len(rows):] + ranks[:order % len(rows)]:
            if position[rank] == len(rows[rank]):
                continue
            action: Action = rows[rank][position[rank]]
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                key = message_key(action)
                posted.add(key)
                peer = schedule.stage_to_rank[key[2]]
                pending[rank].add(_Work(key, received), dst=peer, key=key)
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                key = message_key(action)
                if key not in posted:
                    continue  # blocked on the sender
                received.add(key)
                pending[rank].received(src=schedule.stage_to_rank[key[1]], key=key)
            position[rank] += 1
            most[rank] = max(most[rank], len(pending[rank].works))
            moved = True
        assert moved, "the programs deadlocked"
    for p in pending:
        p.wait_all()
    return most


@pytest.mark.parametrize(("family", "pp", "m", "knobs"), [
    ("1f1b", 2, 8, {}), ("1f1b", 4, 8, {}), ("gpipe", 3, 6, {}), ("zb-h1", 4, 8, {}),
    ("interleaved", 2, 8, {"virtual_stages": 2}), ("interleaved", 4, 8, {"virtual_stages": 2}),
])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_release_never_blocks(family: str, pp: int, m: int, knobs: dict, order: int) -> None:
    schedule = add_send_recv(generate(family, pp=pp, micro_batches=m, **knobs))
    most = _replay(schedule, order=order)
    if family in ("1f1b", "zb-h1"):
        # The last stage sends a gradient per micro-batch; it used to keep all m until the end.
        assert most[-1] <= 2, most


def test_positions_pair_each_message_with_both_ends() -> None:
    schedule = add_send_recv(generate("1f1b", pp=3, micro_batches=4))
    positions = message_positions(schedule)
    sends = [a for row in schedule.actions for a in row if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    assert len(positions) == len(sends) == 2 * 2 * 4
    row1 = schedule.actions[1]
    recv_at, _ = positions[(Kind.SEND_F, 0, 1, 2)]
    assert row1[recv_at] == Action(1, Kind.RECV_F, 2)
    _, send_at = positions[(Kind.SEND_B, 1, 0, 2)]
    assert row1[send_at] == Action(1, Kind.SEND_B, 2)
