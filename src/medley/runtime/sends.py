"""When a pipeline send is known to be done, so its tensor can go before the step ends.

A rank posts its sends in batches (``batch_isend_irecv``) and cannot poll them (gloo's
``is_completed()`` stays False until ``wait()``), and waiting on one too early can deadlock
against the peer. The schedule says when it is safe: in :mod:`medley.runtime.executor` a receive
is waited for right before the compute action that consumes it, so once this rank has received a
message that the peer sends *after* the action where it waited for one of our messages, that
message has arrived, and waiting on its send returns at once. Without this, every input gradient
a stage sends stays alive until the end of the step.

Between TP groups of unlike degrees a rank may send to a peer that never sends back to it (a tp1
stage feeding a tp2 one sends each input gradient to both TP ranks and hears from one). Its
members run one program and meet in the TP all-reduces of every forward and backward of a stage
with blocks (``synced_stages``): once the member that does send to us has passed such an action
that comes after the receive of one of our messages, every member has passed that receive too.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from medley.schedule.ir import Action, Kind, PipelineSchedule
from medley.schedule.messages import SEND_KINDS, MessageKey, message_key


def message_positions(schedule: PipelineSchedule) -> dict[MessageKey, tuple[int, int]]:
    """For each message: where its receiver waits for it (the position of the compute action
    that consumes it, right before which the executor waits) and its send's position, as
    ``{key: (wait position, send position)}`` (only messages whose both ends are listed)."""
    waited: dict[MessageKey, int] = {}
    sent: dict[MessageKey, int] = {}
    for row in schedule.actions:
        posted: dict[Action, MessageKey] = {}
        for position, action in enumerate(row):
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                posted[action] = message_key(action)
            elif action.kind in SEND_KINDS:
                sent[message_key(action)] = position
            elif action.is_compute and action.kind is not Kind.W and action.micro_batch is not None:
                kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
                key = posted.pop(Action(action.stage, kind, action.micro_batch), None)
                if key is not None:
                    waited[key] = position
    return {key: (waited[key], sent[key]) for key in waited.keys() & sent.keys()}


def tp_meeting(action: Action) -> bool:
    """Whether ``action`` runs its stage's TP all-reduces (when the stage has them): F, BW, and of
    a split backward B, except on the first stage, whose B is empty and whose W does the whole
    backward (token ids take no gradient, :mod:`medley.runtime.executor`)."""
    if action.kind in (Kind.F, Kind.BW):
        return True
    return action.kind is (Kind.W if action.stage == 0 else Kind.B)


@dataclass(kw_only=True)
class PendingSends:
    """This rank's posted sends, released as soon as the schedule proves them delivered.

    Args:
        schedule: the replica's schedule with its transfers placed (what every rank executes).
        pipeline: the global ranks of each pipeline rank of the replica, in TP order (empty: one
            rank each, no TP).
        synced_stages: the stages whose forward and backward run TP all-reduces over their TP
            group (blocks on more than one device).
    """

    schedule: PipelineSchedule
    pipeline: Sequence[Sequence[int]] = ()
    synced_stages: frozenset[int] = frozenset()
    works: list[tuple[dist.Work, int, MessageKey]] = field(default_factory=list)
    positions: dict[MessageKey, tuple[int, int]] = field(init=False)
    group_of: dict[int, tuple[int, ...]] = field(init=False)
    syncs: dict[int, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.positions = message_positions(self.schedule)
        self.group_of, self.syncs = {}, {}
        for k, group in enumerate(self.pipeline):
            if len(group) < 2:
                continue
            row = self.schedule.actions[k]
            syncs = [i for i, a in enumerate(row) if a.stage in self.synced_stages and tp_meeting(a)]
            for rank in group:
                self.group_of[rank], self.syncs[rank] = tuple(group), syncs

    def _delivered(self, dst: int, mine: MessageKey, *, src: int, sent_at: int) -> bool:
        """Whether ``src``'s send at ``sent_at`` proves that ``dst`` took our message ``mine``."""
        taken_at = self.positions[mine][0]
        if dst == src:
            return taken_at < sent_at
        if dst not in self.group_of.get(src, ()):
            return False
        syncs = self.syncs[src]
        after = bisect_right(syncs, taken_at)  # the first TP meeting after dst's receive
        return after < len(syncs) and syncs[after] < sent_at

    def add(self, work: dist.Work, *, dst: int, key: MessageKey) -> None:
        """A send of ``key`` to global rank ``dst`` was posted."""
        self.works.append((work, dst, key))

    def received(self, *, src: int, key: MessageKey) -> None:
        """This rank finished receiving ``key`` from global rank ``src``: every send to ``src``
        whose message that rank takes before it sent ``key`` is done, and every send to another
        member of its TP group that took ours before a TP meeting ``src`` passed before sending
        ``key``; wait on them and drop them."""
        sent_at = self.positions[key][1]
        keep = []
        for work, dst, mine in self.works:
            if self._delivered(dst, mine, src=src, sent_at=sent_at):
                work.wait()
            else:
                keep.append((work, dst, mine))
        self.works = keep

    def wait_all(self) -> None:
        """End of the step: wait on what is left."""
        for work, _, _ in self.works:
            work.wait()
        self.works.clear()
