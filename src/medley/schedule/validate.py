"""Schedule validator: placement, completeness, order, send/recv matching, the order of each rank
pair's messages, deadlock as NCCL runs the transfers, memory (:mod:`medley.schedule.messages`).

Every error is a :class:`ScheduleError` whose message names the rank, the action and the rule.
ZeRO collectives (UNSHARD, RESHARD, REDUCE_GRAD, OPTIM) are skipped here; the ZeRO pass checks
its own actions.

Activation memory is counted in micro-batches of one stage: +1 at F, -1 at BW. With a split
backward, B frees ``1 - w_fraction`` and W the remaining ``w_fraction``: the part of the
activations (mostly the inputs of linear layers) that must stay alive until the weight gradient
is computed. The default ``w_fraction=1.0`` counts a micro-batch until its W, which is
conservative and keeps counts integral; the zero-bubble runtime's priors put it near 0.3.
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.schedule.ir import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    P2P_KINDS,
    Action,
    Kind,
    PipelineSchedule,
    add_send_recv,
    p2p_peer_stage,
)
from medley.schedule.messages import pair_order_error, transfer_runs
from medley.schedule.validate_fast import runs_cleanly


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank, the action and the rule."""


def _fail(rank: int, action: Action | str, rule: str, position: int | None = None) -> ScheduleError:
    where = f" (position {position})" if position is not None else ""
    return ScheduleError(f"rank {rank}, action {action}{where}: {rule}")


def validate(
    schedule: PipelineSchedule,
    *,
    activation_limit: Sequence[float] | None = None,
    w_fraction: float = 1.0,
) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a correct, deadlock-free program.

    A compute-only schedule is lowered with :func:`add_send_recv` before it is executed; a
    schedule that already holds SEND/RECV actions is executed as given. ``activation_limit[rank]``
    caps that rank's in-flight activations (see the module docstring for the unit).
    """
    _check_shape(schedule)
    if not runs_cleanly(schedule):  # the integer-indexed proof; else look rule by rule
        check_rules(schedule)
    if activation_limit is not None:
        _check_memory(schedule, activation_limit, w_fraction)


def check_rules(schedule: PipelineSchedule) -> None:
    """The rules of :func:`validate` but the activation limit, one by one on the actions, raising
    at the first broken one (what :func:`validate` runs when the fast proof does not go through)."""
    _check_shape(schedule)
    _check_compute(schedule)
    has_p2p = any(a.kind in P2P_KINDS for row in schedule.actions for a in row)
    lowered = schedule if has_p2p else add_send_recv(schedule)
    _check_p2p(lowered)
    _execute(lowered)
    error = pair_order_error(lowered)
    if error is not None:
        raise ScheduleError(error)


def _check_shape(schedule: PipelineSchedule) -> None:
    if len(schedule.stage_to_rank) != schedule.num_stages:
        raise ScheduleError(
            f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {schedule.num_stages} stages"
        )
    bad = [r for r in schedule.stage_to_rank if not 0 <= r < schedule.num_ranks]
    if bad:
        raise ScheduleError(f"stage_to_rank names ranks {bad}; the schedule has {schedule.num_ranks} ranks")
    spans = schedule.micro_batch_stages
    if spans and len(spans) != schedule.num_micro_batches:
        raise ScheduleError(
            f"micro_batch_stages has {len(spans)} spans for {schedule.num_micro_batches} micro-batches"
        )
    for mb, (first, last) in enumerate(spans):
        if not 0 <= first <= last < schedule.num_stages:
            raise ScheduleError(f"micro-batch {mb} has span ({first}, {last}) outside the stages")


def _check_compute(schedule: PipelineSchedule) -> None:
    """Placement, exactly-once, and the per-rank order F < B < W (or F < BW)."""
    m = schedule.num_micro_batches
    seen: set[tuple[int, Kind, int]] = set()
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            if action.kind in COLLECTIVE_KINDS:
                continue
            s, mb = action.stage, action.micro_batch
            assert mb is not None
            if s >= schedule.num_stages:
                raise _fail(rank, action, f"stage {s} does not exist ({schedule.num_stages} stages)", pos)
            if schedule.stage_to_rank[s] != rank:
                raise _fail(rank, action, f"stage {s} belongs on rank {schedule.stage_to_rank[s]}", pos)
            if mb >= m:
                raise _fail(rank, action, f"micro-batch {mb} does not exist ({m} micro-batches)", pos)
            first, last = schedule.stage_span(mb)
            if not first <= s <= last:
                raise _fail(rank, action, f"micro-batch {mb} only flows through stages {first}..{last}", pos)
            if action.kind not in COMPUTE_KINDS:
                continue
            key = (s, action.kind, mb)
            if key in seen:
                raise _fail(rank, action, f"each (stage, micro-batch) runs exactly one {action.kind}", pos)
            if action.kind is Kind.F:
                if {(s, Kind.B, mb), (s, Kind.BW, mb)} & seen:
                    raise _fail(rank, action, "F must come before its backward", pos)
            elif action.kind in (Kind.B, Kind.BW):
                if (s, Kind.F, mb) not in seen:
                    raise _fail(rank, action, "backward before its F", pos)
                other = Kind.BW if action.kind is Kind.B else Kind.B
                if (s, other, mb) in seen or (s, Kind.W, mb) in seen:
                    raise _fail(rank, action, "a micro-batch takes either one BW or one B then one W", pos)
            elif (s, Kind.B, mb) not in seen:
                raise _fail(rank, action, "W before its B (or W after a fused BW)", pos)
            seen.add(key)
    for mb in range(m):
        first, last = schedule.stage_span(mb)
        for s in range(first, last + 1):
            rank = schedule.stage_to_rank[s]
            if (s, Kind.F, mb) not in seen:
                raise _fail(rank, Action(s, Kind.F, mb), "missing: every (stage, micro-batch) needs one F")
            if (s, Kind.B, mb) in seen and (s, Kind.W, mb) not in seen:
                raise _fail(rank, Action(s, Kind.W, mb), "missing: a split backward needs its W")
            if (s, Kind.B, mb) not in seen and (s, Kind.BW, mb) not in seen:
                raise _fail(rank, Action(s, Kind.BW, mb), "missing: its backward (BW, or B and W)")


_PRODUCER = {Kind.SEND_F: (Kind.F,), Kind.SEND_B: (Kind.B, Kind.BW)}
_MATCH = {
    Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B, Kind.RECV_F: Kind.SEND_F, Kind.RECV_B: Kind.SEND_B,
}
def _peer(schedule: PipelineSchedule, rank: int, action: Action, pos: int) -> Action:
    """The action on the peer rank that must match this SEND or RECV."""
    peer_stage = p2p_peer_stage(action)
    assert action.micro_batch is not None
    first, last = schedule.stage_span(action.micro_batch)
    if not first <= peer_stage <= last:
        raise _fail(rank, action, f"no peer: stage {peer_stage} is outside the micro-batch's stages", pos)
    return Action(peer_stage, _MATCH[action.kind], action.micro_batch)


def _check_p2p(schedule: PipelineSchedule) -> None:
    """Each SEND matched by exactly one RECV on the peer rank (and back), each placed sensibly."""
    where: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            if action.kind not in P2P_KINDS:
                continue
            if action in where:
                raise _fail(rank, action, "sent or received twice", pos)
            where[action] = rank, pos
    for action, (rank, pos) in where.items():
        peer = _peer(schedule, rank, action, pos)
        peer_rank = schedule.stage_to_rank[peer.stage]
        if peer_rank == rank:
            raise _fail(rank, action, f"peer stage {peer.stage} is on the same rank; no transfer is needed")
        if where.get(peer, (None,))[0] != peer_rank:
            raise _fail(rank, action, f"unmatched: rank {peer_rank} has no {peer}")
    # A cross-rank consumer needs its RECV earlier in its own row.
    for rank, row in enumerate(schedule.actions):
        done: set[Action] = set()
        for pos, action in enumerate(row):
            needed = _recv_needed(schedule, rank, action)
            if needed is not None and needed not in done:
                raise _fail(rank, action, f"needs data from another rank but {needed} is not before it", pos)
            done.add(action)


def _recv_needed(schedule: PipelineSchedule, rank: int, action: Action) -> Action | None:
    if action.kind not in (Kind.F, Kind.B, Kind.BW):
        return None
    assert action.micro_batch is not None
    first, last = schedule.stage_span(action.micro_batch)
    if action.kind is Kind.F and action.stage > first and schedule.stage_to_rank[action.stage - 1] != rank:
        return Action(action.stage, Kind.RECV_F, action.micro_batch)
    if action.kind is not Kind.F and action.stage < last and schedule.stage_to_rank[action.stage + 1] != rank:
        return Action(action.stage, Kind.RECV_B, action.micro_batch)
    return None


def _dependencies(schedule: PipelineSchedule, rank: int, action: Action) -> list[tuple[Action, ...]]:
    """Groups of actions that must be done first; one action of each group suffices."""
    kind, s, mb = action.kind, action.stage, action.micro_batch
    if kind in COLLECTIVE_KINDS:
        return []
    assert mb is not None
    if kind in (Kind.RECV_F, Kind.RECV_B):
        return [(Action(p2p_peer_stage(action), _MATCH[kind], mb),)]
    if kind in _PRODUCER:
        return [tuple(Action(s, k, mb) for k in _PRODUCER[kind])]
    if kind is Kind.W:
        return [(Action(s, Kind.B, mb),)]
    first, last = schedule.stage_span(mb)
    recv = _recv_needed(schedule, rank, action)
    if kind is Kind.F:
        if s == first:
            return []
        return [(recv,)] if recv is not None else [(Action(s - 1, Kind.F, mb),)]
    deps: list[tuple[Action, ...]] = [(Action(s, Kind.F, mb),)]
    if s < last:
        deps.append((recv,) if recv is not None else (Action(s + 1, Kind.B, mb), Action(s + 1, Kind.BW, mb)))
    return deps


def _execute(schedule: PipelineSchedule) -> None:
    """Run the program with zero durations as NCCL runs it: each run of consecutive SEND/RECV
    actions is one batch (:func:`~medley.schedule.messages.transfer_runs`), which ends once every
    send's producer is done and the peer of each of its messages has reached the batch holding the
    other end (a large send waits for its receive); compute actions wait for their inputs."""
    rows = schedule.actions
    run_of: list[dict[int, tuple[int, int]]] = [
        {p: run for run in transfer_runs(row) for p in range(*run)} for row in rows]
    where = {a: (r, p) for r, row in enumerate(rows) for p, a in enumerate(row) if a.kind in P2P_KINDS}
    done: set[Action] = set()
    cursor = [0] * schedule.num_ranks
    deps = [[_dependencies(schedule, r, a) for a in row] for r, row in enumerate(rows)]

    def blockers(rank: int, i: int) -> list[str]:
        """What the action (or batch) at position ``i`` of ``rank`` still waits for."""
        if i not in run_of[rank]:
            return [" or ".join(map(str, g)) for g in deps[rank][i] if not any(d in done for d in g)]
        waits = []
        for p in range(*run_of[rank][i]):
            action = rows[rank][p]
            waits += [" or ".join(map(str, g)) for g in deps[rank][p]
                      if action.kind not in (Kind.RECV_F, Kind.RECV_B) and not any(d in done for d in g)]
            peer, at = where[_peer(schedule, rank, action, p)]
            if cursor[peer] < run_of[peer][at][0]:
                waits.append(f"rank {peer} to reach {rows[peer][at]} (position {at})")
        return waits

    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(rows):
            i = cursor[rank]
            while i < len(row) and not blockers(rank, i):
                end = run_of[rank][i][1] if i in run_of[rank] else i + 1
                done.update(row[i:end])
                i = end
            progress |= i != cursor[rank]
            cursor[rank] = i
    stuck = [r for r, row in enumerate(rows) if cursor[r] < len(row)]
    if stuck:
        parts = [f"rank {r} at {rows[r][cursor[r]]} (position {cursor[r]}) waits for "
                 + ", ".join(blockers(r, cursor[r])) for r in stuck]
        raise ScheduleError(
            f"rank {stuck[0]}, action {rows[stuck[0]][cursor[stuck[0]]]}: deadlock, no rank can advance "
            "with zero durations when each send waits for its receive (NCCL); " + "; ".join(parts)
        )


def _deltas(w_fraction: float) -> dict[Kind, float]:
    return {Kind.F: 1.0, Kind.BW: -1.0, Kind.B: -(1.0 - w_fraction), Kind.W: -w_fraction}


def _check_memory(schedule: PipelineSchedule, limit: Sequence[float], w_fraction: float) -> None:
    if len(limit) != schedule.num_ranks:
        raise ScheduleError(f"activation_limit has {len(limit)} entries for {schedule.num_ranks} ranks")
    delta = _deltas(w_fraction)
    for rank, row in enumerate(schedule.actions):
        held = 0.0
        for pos, action in enumerate(row):
            held += delta.get(action.kind, 0.0)
            if held > limit[rank] + 1e-9:
                raise _fail(
                    rank, action,
                    f"activation memory {held:g} micro-batches exceeds the limit {limit[rank]:g}", pos,
                )


def in_flight_by_stage(
    schedule: PipelineSchedule, *, w_fraction: float = 1.0
) -> list[list[tuple[float, ...]]]:
    """Activations each rank holds after each of its actions, per stage it runs (micro-batches of
    that stage, the rank's stages in :meth:`~medley.schedule.ir.PipelineSchedule.stages_of_rank`
    order)."""
    delta = _deltas(w_fraction)
    profile = []
    for rank, row in enumerate(schedule.actions):
        column = {s: i for i, s in enumerate(schedule.stages_of_rank(rank))}
        held, trace = [0.0] * len(column), []
        for action in row:
            if action.kind in delta:
                held[column[action.stage]] += delta[action.kind]
            trace.append(tuple(held))
        profile.append(trace)
    return profile


def in_flight_profile(schedule: PipelineSchedule, *, w_fraction: float = 1.0) -> list[list[float]]:
    """Activations held by each rank after each of its actions (micro-batches of one stage)."""
    return [[sum(held) for held in trace] for trace in in_flight_by_stage(schedule, w_fraction=w_fraction)]


def peak_in_flight(schedule: PipelineSchedule) -> list[int]:
    """Per rank, the most micro-batches whose activations are alive at once (F until BW or W)."""
    return [int(max(trace, default=0.0)) for trace in in_flight_profile(schedule)]
