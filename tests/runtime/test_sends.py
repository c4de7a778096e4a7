"""The release of pipeline sends: never a wait that could block, and few sends left alive.

The programs of every rank are replayed with the runtime's semantics (sends and receives posted
without blocking, the compute action that consumes a received message waiting until it was
sent), in every interleaving a round-robin
over ready ranks produces; each wait the release rule issues must find its message already
received, and the last stage must hold at most a couple of sent gradients at any time.
"""

from __future__ import annotations

import pytest

from medley.plan.layout import tp_sources
from medley.runtime.sends import PendingSends, message_positions, tp_meeting
from medley.schedule.generators import generate
from medley.schedule.ir import P2P_KINDS, Action, Kind, PipelineSchedule, add_send_recv, p2p_peer_stage
from medley.schedule.messages import message_key


class _Work:
    """A posted send; its wait is legal only once the receiver took the message."""

    def __init__(self, key: tuple, dst: int, received: set) -> None:
        self.key, self.dst, self.received = key, dst, received

    def wait(self) -> None:
        assert (self.key, self.dst) in self.received, f"wait on {self.key} to {self.dst} before its receive"


def _replay(schedule: PipelineSchedule, *, order: int, tp: tuple[int, ...] | None = None) -> list[int]:
    """Run every global rank's program to the end (pipeline rank k on ``tp[k]`` ranks, which
    exchange with the peer group as the executor does, :func:`tp_sources`); a rank passes a TP
    meeting (an F or backward of a stage with TP all-reduces) only once its whole group reached
    it. Returns each global rank's most sends alive at once."""
    tp = tp or (1,) * schedule.num_ranks
    firsts = [sum(tp[:k]) for k in range(len(tp))]
    pipeline = [tuple(range(first, first + t)) for first, t in zip(firsts, tp, strict=True)]
    place = {rank: (k, j) for k, group in enumerate(pipeline) for j, rank in enumerate(group)}
    synced = frozenset(s for s in range(schedule.num_stages) if tp[schedule.stage_to_rank[s]] > 1)
    ranks = sorted(place)
    rows = [schedule.actions[place[rank][0]] for rank in ranks]
    pending = [PendingSends(schedule=schedule, pipeline=pipeline, synced_stages=synced) for _ in ranks]
    position, posted, received = [0] * len(ranks), set(), set()
    receiving: list[dict[tuple, tuple]] = [{} for _ in ranks]  # posted receives, not yet waited for
    most = [0] * len(ranks)

    def peers(rank: int, peer_stage: int, *, sending: bool) -> list[int]:
        k, j = place[rank]
        theirs = pipeline[schedule.stage_to_rank[peer_stage]]
        if sending:
            sources = tp_sources(senders=len(pipeline[k]), receivers=len(theirs))
            return [peer for peer, source in zip(theirs, sources, strict=True) if source == j]
        return [theirs[tp_sources(senders=len(theirs), receivers=len(pipeline[k]))[j]]]

    while any(p < len(row) for p, row in zip(position, rows, strict=True)):
        moved = False
        for rank in ranks[order % len(ranks):] + ranks[:order % len(ranks)]:
            if position[rank] == len(rows[rank]):
                continue
            action: Action = rows[rank][position[rank]]
            key = message_key(action) if action.kind in P2P_KINDS else None
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                for peer in peers(rank, p2p_peer_stage(action), sending=True):
                    posted.add((key, peer))
                    pending[rank].add(_Work(key, peer, received), dst=peer, key=key)
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                receiving[rank][(action.stage, action.kind, action.micro_batch)] = (
                    key, peers(rank, p2p_peer_stage(action), sending=False)[0])
            else:
                if action.is_compute and action.kind is not Kind.W:
                    kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
                    waits = receiving[rank].get((action.stage, kind, action.micro_batch))
                    if waits is not None:
                        if (waits[0], rank) not in posted:
                            continue  # waits for the sender
                        del receiving[rank][(action.stage, kind, action.micro_batch)]
                        received.add((waits[0], rank))
                        pending[rank].received(src=waits[1], key=waits[0])
                if action.stage in synced and tp_meeting(action):
                    group = pipeline[place[rank][0]]
                    if any(position[member] < position[rank] for member in group):
                        continue  # the all-reduce waits for the whole group
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
    wait_at, _ = positions[(Kind.SEND_F, 0, 1, 2)]
    assert row1[wait_at] == Action(1, Kind.F, 2) and row1[wait_at - 1] == Action(1, Kind.RECV_F, 2)
    _, send_at = positions[(Kind.SEND_B, 1, 0, 2)]
    assert row1[send_at] == Action(1, Kind.SEND_B, 2)


@pytest.mark.parametrize("tp", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 1, 2)])
@pytest.mark.parametrize(("family", "knobs"), [("1f1b", {}), ("zb-h1", {}), ("gpipe", {}),
                                               ("interleaved", {"virtual_stages": 2})])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_release_between_tp_groups_of_unlike_degrees(tp: tuple[int, ...], family: str, knobs: dict,
                                                     order: int) -> None:
    """A rank that sends to a TP rank which never sends back to it (a tp1 stage's input gradients
    to a tp2 stage's second rank) releases those sends once the rank that does answer has passed
    a TP all-reduce after their receive; every wait still finds its message taken, and (but for
    GPipe, whose forwards all come first) what a rank holds does not grow with the micro-batches:
    the tp1 rank next to a tp2 stage used to keep every gradient it sent to the silent rank."""
    most = [_replay(add_send_recv(generate(family, pp=len(tp), micro_batches=m, **knobs)), order=order, tp=tp)
            for m in (8, 16)]
    if family != "gpipe":
        assert most[0] == most[1], most
