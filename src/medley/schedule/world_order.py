"""Whether the programs of every replica run to their end together, as the runtime runs them.

The runtime executes each rank's actions in order: a send is posted and left (``isend``), a
receive waits for its send, and a collective waits until every member of its group has reached
it. Replicas of one shape issue their collectives in one common order
(:func:`medley.schedule.zero.place_collectives`); replicas of their own shape meet in the ZeRO
groups of sync segments (:mod:`medley.plan.segments`) at unlike positions of unlike pipelines, and
a rank waiting in one group while a member it needs waits in another would hang the run.
:func:`check_world_order` executes every program at once under those rules (no durations) and
names where they stop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

from medley.schedule.ir import Action, Kind, PipelineSchedule, add_send_recv, p2p_peer_stage

Rank = tuple[int, int]
"""(global replica, pipeline rank): a TP group runs one program, so its lead stands for it."""

CollectiveKey = Callable[[int, Action], tuple[tuple[Rank, ...], Hashable] | None]
"""``key(replica, action)``: the ranks a collective waits for and what identifies it among them
(the n-th occurrence of one identity on each member is one collective), or None for an action
that waits for no one (a local step, or a group of one)."""


class WorldOrderError(ValueError):
    """The programs stop before their end: a rank waits for a collective or a transfer that never
    comes."""


def check_world_order(schedules: Sequence[PipelineSchedule], key: CollectiveKey) -> None:
    """Raise :class:`WorldOrderError` unless every replica's program (lowered if compute-only)
    runs to its end when receives wait for their sends and collectives for all their members."""
    programs: dict[Rank, list[Action]] = {}
    for replica, schedule in enumerate(schedules):
        if not any(a.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
                   for row in schedule.actions for a in row) and schedule.num_ranks > 1:
            schedule = add_send_recv(schedule)
        for rank, row in enumerate(schedule.actions):
            programs[(replica, rank)] = row
    position = dict.fromkeys(programs, 0)
    posted: set[tuple[int, Kind, int, int]] = set()
    waiting_for_send: dict[tuple[int, Kind, int, int], Rank] = {}
    seen: dict[tuple[Rank, Hashable], int] = {}
    arrived: dict[Hashable, set[Rank]] = {}
    done: set[Hashable] = set()
    at: dict[Rank, Hashable] = {}  # the collective instance a rank waits in
    ready = deque(programs)
    while ready:
        me = ready.popleft()
        replica = me[0]
        row = programs[me]
        while position[me] < len(row):
            action = row[position[me]]
            kind = action.kind
            if kind in (Kind.RECV_F, Kind.RECV_B):
                message = (replica, kind, action.stage, action.micro_batch)
                if message not in posted:
                    waiting_for_send[message] = me
                    break
            elif kind in (Kind.SEND_F, Kind.SEND_B):
                receive = Kind.RECV_F if kind is Kind.SEND_F else Kind.RECV_B
                message = (replica, receive, p2p_peer_stage(action), action.micro_batch)
                posted.add(message)
                if message in waiting_for_send:
                    ready.append(waiting_for_send.pop(message))
            else:
                found = key(replica, action)
                if found is not None and len(found[0]) > 1:
                    members, identity = found
                    if me not in at:
                        nth = seen.get((me, identity), 0)
                        seen[(me, identity)] = nth + 1
                        at[me] = (identity, nth)
                        arrived.setdefault(at[me], set()).add(me)
                        if len(arrived[at[me]]) == len(members):
                            done.add(at[me])
                            ready.extend(m for m in members if m != me and m in at and at[m] == at[me])
                    if at[me] not in done:
                        break
                    del at[me]
            position[me] += 1
    stuck = [(rank, row[position[rank]]) for rank, row in programs.items() if position[rank] < len(row)]
    if stuck:
        shown = ", ".join(f"replica {r} pipeline rank {k} at {action}" for (r, k), action in stuck[:4])
        more = f" and {len(stuck) - 4} more" if len(stuck) > 4 else ""
        raise WorldOrderError(f"the replicas' programs hang: {shown}{more} wait for each other")
