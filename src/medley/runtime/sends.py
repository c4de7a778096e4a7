"""When a pipeline send is known to be done, so its tensor can go before the step ends.

A rank posts its sends with ``isend`` and cannot poll them (gloo's ``is_completed()`` stays
False until ``wait()``), and waiting on one too early can deadlock against the peer. The
schedule says when it is safe: a receive is blocking in :mod:`medley.runtime.executor`, so once
this rank has received a message that the peer sends *after* its receive of one of our
messages, that message has arrived, and waiting on its send returns at once. Without this,
every input gradient a stage sends stays alive until the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from medley.schedule.ir import Action, Kind, PipelineSchedule, p2p_peer_stage

# (direction, sending stage, receiving stage, micro-batch): one message of the step.
MessageKey = tuple[Kind, int, int, int]


def message_key(action: Action) -> MessageKey:
    """The message a SEND_* or RECV_* action sends or takes, the same at both ends."""
    peer = p2p_peer_stage(action)
    if action.kind in (Kind.SEND_F, Kind.SEND_B):
        direction, sender, receiver = action.kind, action.stage, peer
    else:
        direction = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
        sender, receiver = peer, action.stage
    if action.micro_batch is None:
        raise ValueError(f"{action}: a transfer names its micro-batch")
    return direction, sender, receiver, action.micro_batch


def message_positions(schedule: PipelineSchedule) -> dict[MessageKey, tuple[int, int]]:
    """For each message: its receive's and its send's position in their ranks' programs, as
    ``{key: (receive position, send position)}`` (only messages whose both ends are listed)."""
    received: dict[MessageKey, int] = {}
    sent: dict[MessageKey, int] = {}
    for row in schedule.actions:
        for position, action in enumerate(row):
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                received[message_key(action)] = position
            elif action.kind in (Kind.SEND_F, Kind.SEND_B):
                sent[message_key(action)] = position
    return {key: (received[key], sent[key]) for key in received.keys() & sent.keys()}


@dataclass(kw_only=True)
class PendingSends:
    """This rank's posted sends, released as soon as the schedule proves them delivered.

    Args:
        schedule: the replica's schedule with its transfers placed (what every rank executes).
    """

    schedule: PipelineSchedule
    works: list[tuple[dist.Work, int, MessageKey]] = field(default_factory=list)
    positions: dict[MessageKey, tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.positions = message_positions(self.schedule)

    def add(self, work: dist.Work, *, dst: int, key: MessageKey) -> None:
        """A send of ``key`` to global rank ``dst`` was posted."""
        self.works.append((work, dst, key))

    def received(self, *, src: int, key: MessageKey) -> None:
        """This rank finished receiving ``key`` from global rank ``src``: every send to ``src``
        whose message that rank takes before it sent ``key`` is done; wait on it and drop it."""
        sent_at = self.positions[key][1]
        keep = []
        for work, dst, mine in self.works:
            if dst == src and self.positions[mine][0] < sent_at:
                work.wait()
            else:
                keep.append((work, dst, mine))
        self.works = keep

    def wait_all(self) -> None:
        """End of the step: wait on what is left."""
        for work, _, _ in self.works:
            work.wait()
        self.works.clear()
