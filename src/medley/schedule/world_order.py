"""Whether the programs of every replica run to their end together, as the runtime runs them.

The runtime executes each rank's actions in order: each run of consecutive transfers is one batch,
which ends once the other end of each of its messages has been reached (NCCL: a large send waits
for its receive, :mod:`medley.schedule.messages`), and a collective waits until every member of
its group has reached it. Replicas of one shape issue their collectives in one common order
(:func:`medley.schedule.zero.place_collectives`); replicas of their own shape meet in the ZeRO
groups of sync segments (:mod:`medley.plan.segments`) at unlike positions of unlike pipelines, and
a rank waiting in one group while a member it needs waits in another would hang the run.
:func:`check_world_order` executes every program at once under those rules (no durations) and
names where they stop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

from medley.schedule.ir import P2P_KINDS, Action, PipelineSchedule, add_send_recv
from medley.schedule.messages import SEND_KINDS, MessageKey, message_key, transfer_runs

Rank = tuple[int, int]
"""(global replica, pipeline rank): a TP group runs one program, so its lead stands for it."""

CollectiveKey = Callable[[int, Action], tuple[tuple[Rank, ...], Hashable] | None]
"""``key(replica, action)``: the ranks a collective waits for and what identifies it among them
(the n-th occurrence of one identity on each member is one collective), or None for an action
that waits for no one (a local step, or a group of one)."""


class WorldOrderError(ValueError):
    """The programs stop before their end: a rank waits for a collective or a transfer that never
    comes."""


def check_world_order(schedules: Sequence[PipelineSchedule], key: CollectiveKey,
                      kin: Callable[[int], Hashable] | None = None) -> None:
    """Raise :class:`WorldOrderError` unless every replica's program (lowered if compute-only)
    runs to its end when batches of transfers wait for the other ends of their messages and
    collectives for all their members.

    ``kin(replica)``: replicas of one kin that run one program (equal schedules) have
    the same collective keys for every action and meet in every collective either member joins,
    so they reach each collective together: one of them stands for all (the first), the others'
    programs are not walked (a 1,024-device plan of 64 alike replicas walks one per group). The
    verdict is the same; the error names the stand-ins."""
    stand_ins: dict[Hashable, list[int]] = {}
    for replica, schedule in enumerate(schedules):
        alike = stand_ins.setdefault(replica if kin is None else kin(replica), [])
        if not any(schedules[other] is schedule or schedules[other] == schedule for other in alike):
            alike.append(replica)
    walked = frozenset(r for alike in stand_ins.values() for r in alike)
    lowered: dict[int, PipelineSchedule] = {}
    programs: dict[Rank, list[Action]] = {}
    for replica in sorted(walked):
        schedule = schedules[replica]
        if id(schedule) not in lowered:
            lowers = not any(a.kind in P2P_KINDS for row in schedule.actions for a in row)
            needs = schedule.num_ranks > 1 and lowers
            lowered[id(schedule)] = add_send_recv(schedule) if needs else schedule
        for rank, row in enumerate(lowered[id(schedule)].actions):
            programs[(replica, rank)] = row
    keys: dict[tuple[Hashable, Action], tuple[tuple[Rank, ...], Hashable] | None] = {}

    def walked_key(replica: int, action: Action) -> tuple[tuple[Rank, ...], Hashable] | None:
        memo = (replica if kin is None else kin(replica), action)
        if memo not in keys:
            found = key(replica, action)
            keys[memo] = None if found is None else (tuple(m for m in found[0] if m[0] in walked), found[1])
        return keys[memo]

    position = dict.fromkeys(programs, 0)
    # Each message's ends: (replica, message) -> {SEND or RECV side: (rank, start of its batch)}.
    batch_start: dict[Rank, dict[int, int]] = {}
    ends: dict[tuple[int, MessageKey], dict[bool, tuple[Rank, int]]] = {}
    for me, row in programs.items():
        starts = batch_start[me] = {}
        for start, end in transfer_runs(row):
            for p in range(start, end):
                starts[p] = start
                ends.setdefault((me[0], message_key(row[p])), {})[row[p].kind in SEND_KINDS] = (me, start)
    waiting_on: dict[Rank, set[Rank]] = {}  # a rank -> the ranks whose batch waits for it to move
    seen: dict[tuple[Rank, Hashable], int] = {}
    arrived: dict[Hashable, set[Rank]] = {}
    done: set[Hashable] = set()
    at: dict[Rank, Hashable] = {}  # the collective instance a rank waits in
    ready = deque(programs)
    while ready:
        me = ready.popleft()
        replica = me[0]
        row = programs[me]
        moved = False
        while position[me] < len(row):
            action = row[position[me]]
            if action.kind in P2P_KINDS:
                # A batch of transfers ends once the other end of each message is reached (NCCL).
                start, late = position[me], None
                while position[me] < len(row) and batch_start[me].get(position[me]) == start:
                    here = row[position[me]]
                    other = ends[(replica, message_key(here))].get(here.kind not in SEND_KINDS)
                    if other is None or position[other[0]] < other[1]:
                        late = other
                        break
                    position[me] += 1
                if late is not None:
                    position[me] = start
                    waiting_on.setdefault(late[0], set()).add(me)
                    break
                moved = True
                continue
            found = walked_key(replica, action)
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
            moved = True
        if moved:
            ready.extend(waiting_on.pop(me, ()))
    stuck = [(rank, row[position[rank]]) for rank, row in programs.items() if position[rank] < len(row)]
    if stuck:
        shown = ", ".join(f"replica {r} pipeline rank {k} at {action}" for (r, k), action in stuck[:4])
        more = f" and {len(stuck) - 4} more" if len(stuck) > 4 else ""
        raise WorldOrderError(f"the replicas' programs hang: {shown}{more} wait for each other")
