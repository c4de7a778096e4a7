"""The messages of a lowered schedule, and the two rules NCCL puts on them.

A pipeline transfer is one message: a SEND on one rank and the RECV of the same (direction,
sending stage, receiving stage, micro-batch) on the peer's rank (:func:`message_key`). NCCL
ignores tags: between two ranks it matches the n-th send one way with the n-th receive posted
the other way, so

- **pair order**: for every ordered pair of ranks (a, b), the messages a sends to b come in
  the order b receives them (:func:`pair_order_error`); otherwise two tensors of one shape
  are swapped without an error;
- **rendezvous**: a large send does not end before its receive is posted, and a rank's
  transfers run in program order. The runtime posts each run of consecutive SEND/RECV actions
  as one batch (:func:`transfer_runs`, ``batch_isend_irecv``), and a program must run to its
  end when each batch waits until the peer of each of its messages has reached the batch
  holding the other end (:func:`medley.schedule.validate.validate`,
  :func:`medley.schedule.world_order.check_world_order`).

:func:`medley.schedule.ir.add_send_recv` lowers every schedule so that both hold.
"""

from __future__ import annotations

from medley.schedule.ir import P2P_KINDS, Action, Kind, PipelineSchedule, p2p_peer_stage

# (direction, sending stage, receiving stage, micro-batch): one message of the step.
MessageKey = tuple[Kind, int, int, int]

SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})


def message_key(action: Action) -> MessageKey:
    """The message a SEND_* or RECV_* action sends or takes, the same at both ends."""
    peer = p2p_peer_stage(action)
    if action.kind in SEND_KINDS:
        direction, sender, receiver = action.kind, action.stage, peer
    else:
        direction = Kind.SEND_F if action.kind is Kind.RECV_F else Kind.SEND_B
        sender, receiver = peer, action.stage
    if action.micro_batch is None:
        raise ValueError(f"{action}: a transfer names its micro-batch")
    return direction, sender, receiver, action.micro_batch


def describe(key: MessageKey) -> str:
    """``the activation of micro-batch 3 from stage 0 to stage 1`` (or ``the gradient ...``)."""
    direction, sender, receiver, mb = key
    what = "activation" if direction is Kind.SEND_F else "gradient"
    return f"the {what} of micro-batch {mb} from stage {sender} to stage {receiver}"


def transfer_runs(row: list[Action]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive SEND/RECV actions in a program: what the
    runtime posts as one batch."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, action in enumerate(row + [Action(0, Kind.OPTIM)]):
        if action.kind in P2P_KINDS:
            start = position if start is None else start
        elif start is not None:
            runs.append((start, position))
            start = None
    return runs


def pair_order_error(schedule: PipelineSchedule) -> str | None:
    """Where a rank pair receives in another order than it sends (None: nowhere), naming the
    ranks and the two messages: the first receive that does not take the send of its place."""
    s2r = schedule.stage_to_rank
    sent: dict[tuple[int, int], list[MessageKey]] = {}
    taken: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    for rank, row in enumerate(schedule.actions):
        for position, action in enumerate(row):
            if action.kind not in P2P_KINDS:
                continue
            key = message_key(action)
            if action.kind in SEND_KINDS:
                sent.setdefault((rank, s2r[key[2]]), []).append(key)
            else:
                taken.setdefault((s2r[key[1]], rank), []).append((position, action))
    for (src, dst), receives in sorted(taken.items()):
        sends = sent.get((src, dst), [])
        for n, (position, action) in enumerate(receives):
            mine = message_key(action)
            theirs = sends[n] if n < len(sends) else None
            if theirs != mine:
                what = describe(theirs) if theirs is not None else "nothing"
                return (f"rank {dst}, action {action} (position {position}): receive {n + 1} from rank "
                        f"{src} takes {describe(mine)}, but send {n + 1} of rank {src} to rank {dst} is "
                        f"{what}; NCCL matches a rank pair's n-th send with its n-th receive (tags are "
                        "ignored), so receive in the order the peer sends (add_send_recv does)")
    return None
