"""The schedule IR: one ordered list of actions per pipeline rank.

Generators write it, the ZeRO pass inserts collectives into it, the simulator times it and the
runtime executes it. Stage indices are *global* pipeline stages (virtual stages when a rank holds
several chunks); ``stage_to_rank`` says which rank of the replica runs each stage.

Naming follows the zero-bubble papers, not torch: ``B`` is the input-gradient backward (torch
calls it ``I``), ``W`` the weight-gradient backward and ``BW`` the fused full backward (torch
``B``). :mod:`medley.schedule.torch_csv` translates.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Kind(StrEnum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    OPTIM = "OPTIM"
    # All-reduce of the squared gradient norm over every rank, then the clip: gradient clipping
    # by the global norm needs every stage's reduced gradient before any optimizer step.
    CLIP = "CLIP"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
P2P_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
COLLECTIVE_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD, Kind.OPTIM, Kind.CLIP})
# Kinds that carry a micro-batch index; collectives act on a whole stage (or a bucket of it).
MICRO_BATCH_KINDS = COMPUTE_KINDS | P2P_KINDS


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One step of a rank's program.

    Attributes:
        stage: global (virtual) stage index the action belongs to. For SEND_F/SEND_B it is the
            sending stage, for RECV_F/RECV_B the receiving stage (torch's convention).
        kind: what to do.
        micro_batch: micro-batch index for compute and point-to-point kinds, else None.
        bucket: layer bucket of the stage for ZeRO collectives split into buckets; None means
            the whole stage.
    """

    stage: int
    kind: Kind
    micro_batch: int | None = None
    bucket: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"action stage must be >= 0, got {self.stage}")
        if self.kind in MICRO_BATCH_KINDS and (self.micro_batch is None or self.micro_batch < 0):
            raise ValueError(f"{self.kind} needs a micro-batch index >= 0, got {self.micro_batch}")
        if self.kind in COLLECTIVE_KINDS and self.micro_batch is not None:
            raise ValueError(f"{self.kind} acts on a whole stage and takes no micro-batch")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}"
        if self.micro_batch is not None:
            text += str(self.micro_batch)
        if self.bucket is not None:
            text += f"@{self.bucket}"
        return text

    @staticmethod
    def parse(text: str) -> Action:
        """Parse medley's text form (``2F0``, ``1BW3``, ``0UNSHARD@1``, ``3OPTIM``)."""
        raw = text.strip()
        body, _, bucket_text = raw.partition("@")
        digits = 0
        while digits < len(body) and body[digits].isdigit():
            digits += 1
        if digits == 0:
            raise ValueError(f"action {text!r} must start with a stage index, like '2F0'")
        rest = body[digits:]
        # Longest kind name first, so that "BW3" is not read as "B" + "W3".
        for kind in sorted(Kind, key=lambda k: -len(k.value)):
            if rest.startswith(kind.value):
                tail = rest[len(kind.value) :]
                if tail and not tail.isdigit():
                    continue
                micro_batch = int(tail) if tail else None
                bucket = int(bucket_text) if bucket_text else None
                return Action(int(body[:digits]), kind, micro_batch, bucket)
        raise ValueError(f"action {text!r} has an unknown kind; expected one of {[k.value for k in Kind]}")


def F(stage: int, micro_batch: int) -> Action:  # noqa: N802 - reads like the papers' notation
    return Action(stage, Kind.F, micro_batch)


def B(stage: int, micro_batch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.B, micro_batch)


def W(stage: int, micro_batch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.W, micro_batch)


def BW(stage: int, micro_batch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.BW, micro_batch)


@dataclass(kw_only=True, slots=True)
class PipelineSchedule:
    """The program of one pipeline replica: an ordered action list per pipeline rank.

    Attributes:
        family: generator name (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ...).
        num_stages: number of global (virtual) stages.
        num_micro_batches: micro-batches this replica runs per step.
        stage_to_rank: rank of the replica that runs each global stage.
        actions: ``actions[rank]`` is that rank's ordered program.
        knobs: the integer knobs the generator was called with, for the planner and reports.
        bucket_layers: for stages whose ZeRO collectives are split into layer buckets, the
            number of the stage's layers in each bucket, in order (bucket ``k`` of stage ``s``
            covers the next ``bucket_layers[s][k]`` layers). Stages absent here use one bucket.
        micro_batch_stages: ``(first, last)`` global stage of the chain each micro-batch flows
            through, indexed by micro-batch. Empty (the default, every family but
            ``bidirectional``) means every micro-batch flows through ``0 .. num_stages - 1``.
            A bidirectional schedule sends its down micro-batches through ``0 .. p-1`` and its up
            micro-batches through ``p .. 2p-1``; dependencies (F after F of the stage before,
            B after B of the stage after) only hold inside a micro-batch's span.
    """

    family: str
    num_stages: int
    num_micro_batches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]]
    knobs: dict[str, int | tuple[int, ...]] = field(default_factory=dict)
    bucket_layers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    micro_batch_stages: tuple[tuple[int, int], ...] = ()

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def stage_span(self, micro_batch: int) -> tuple[int, int]:
        """(first, last) global stage that ``micro_batch`` flows through."""
        if self.micro_batch_stages:
            return self.micro_batch_stages[micro_batch]
        return 0, self.num_stages - 1

    def compute_only(self) -> PipelineSchedule:
        """The same schedule with every non-compute action removed."""
        return self.with_actions([[a for a in row if a.is_compute] for row in self.actions])

    def with_actions(self, actions: list[list[Action]]) -> PipelineSchedule:
        return PipelineSchedule(
            family=self.family,
            num_stages=self.num_stages,
            num_micro_batches=self.num_micro_batches,
            stage_to_rank=self.stage_to_rank,
            actions=actions,
            knobs=dict(self.knobs),
            bucket_layers=dict(self.bucket_layers),
            micro_batch_stages=self.micro_batch_stages,
        )

    def to_text(self) -> str:
        """One line per rank, actions comma-separated (the torch CSV layout, medley's names)."""
        return "\n".join(",".join(str(a) for a in row) for row in self.actions) + "\n"


def loop_stage_to_rank(num_ranks: int, chunks_per_rank: int = 1) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % num_ranks`` (1F1B, interleaved)."""
    return tuple(s % num_ranks for s in range(num_ranks * chunks_per_rank))


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: rank r holds stages r and 2p-1-r (ZB-V, DualPipeV)."""
    down = list(range(num_ranks))
    return tuple(down + down[::-1])


def add_send_recv(schedule: PipelineSchedule) -> PipelineSchedule:
    """Lower a compute-only schedule: a SEND right after each producing compute action whose
    consumer stage lives on another rank, and the matching RECV on the consumer's rank, at or
    before the consuming compute action, placed so that NCCL can run the program.

    NCCL ignores tags: it matches the n-th send from rank a to rank b with the n-th receive that b
    posts from a, and a large send does not end before its receive is posted. So the RECVs follow
    the levels of :func:`compute_order` (each compute action as late as its dependencies allow;
    actions of one level never depend on each other): a message is received right before the
    consumer rank's first compute action of a later level than the message's producer, and RECVs
    placed at one point come in their producers' order. Every rank pair then receives in the order
    it sends, and the program runs to its end even when every send waits for its receive: level
    by level, the compute actions of a level run, then the messages they produced are exchanged
    (the validator, :mod:`medley.schedule.validate`, checks both rules). A RECV posts the
    receive; the runtime waits for the data at the consuming action. 1F1B and the like get each
    RECV right before its consumer, in one batch with the sends of the action before.

    Collectives already present are kept where they are; a schedule whose compute actions cannot
    all run (the validator names the deadlock) gets each RECV right before its consumer. The
    result is what the runtime executes and what the simulator times.
    """
    order = compute_order(schedule)
    where = _compute_positions(schedule)
    # Per consumer rank: position to insert before -> [(producer's key, RECV)].
    inserts: list[dict[int, list[tuple[tuple[int, int, int], Action]]]] = [{} for _ in schedule.actions]
    for rank, row in enumerate(schedule.actions):
        # Levels grow along a row (each action follows the rank's earlier ones).
        computes = [p for p in range(len(row)) if (rank, p) in order]
        levels = [order[(rank, p)][0] for p in computes]
        for position, action in enumerate(row):
            needed = _received_input(schedule, rank, action)
            if needed is None:
                continue
            producer = where.get(_producer_of(needed))
            at = position
            if producer is not None and (rank, position) in order:
                produced = order[producer]
                at = computes[bisect_right(levels, produced[0])]
            inserts[rank].setdefault(at, []).append((order.get(producer or (-1, -1), (0, 0, 0)), needed))
    lowered: list[list[Action]] = []
    for rank, row in enumerate(schedule.actions):
        out: list[Action] = []
        for position, action in enumerate(row):
            out.extend(recv for _, recv in sorted(inserts[rank].get(position, ()), key=lambda item: item[0]))
            out.append(action)
            sent = _sent_output(schedule, rank, action)
            if sent is not None:
                out.append(sent)
        lowered.append(out)
    return schedule.with_actions(lowered)


def _received_input(schedule: PipelineSchedule, rank: int, action: Action) -> Action | None:
    """The RECV a compute action needs (its input or output gradient lives on another rank)."""
    if action.kind not in (Kind.F, Kind.B, Kind.BW):
        return None
    first, last = schedule.stage_span(action.micro_batch or 0)
    s2r = schedule.stage_to_rank
    if action.kind is Kind.F and action.stage > first and s2r[action.stage - 1] != rank:
        return Action(action.stage, Kind.RECV_F, action.micro_batch)
    if action.kind is not Kind.F and action.stage < last and s2r[action.stage + 1] != rank:
        return Action(action.stage, Kind.RECV_B, action.micro_batch)
    return None


def _sent_output(schedule: PipelineSchedule, rank: int, action: Action) -> Action | None:
    """The SEND that follows a compute action whose output goes to another rank."""
    if action.kind not in (Kind.F, Kind.B, Kind.BW):
        return None
    first, last = schedule.stage_span(action.micro_batch or 0)
    s2r = schedule.stage_to_rank
    if action.kind is Kind.F and action.stage < last and s2r[action.stage + 1] != rank:
        return Action(action.stage, Kind.SEND_F, action.micro_batch)
    if action.kind is not Kind.F and action.stage > first and s2r[action.stage - 1] != rank:
        return Action(action.stage, Kind.SEND_B, action.micro_batch)
    return None


# A compute action as a dependency: (stage, "F", "B" for B or BW, or "W", micro-batch).
_Node = tuple[int, str, int]


def _node(action: Action) -> _Node:
    return action.stage, {Kind.F: "F", Kind.W: "W"}.get(action.kind, "B"), action.micro_batch or 0


def _producer_of(recv: Action) -> _Node:
    """The compute action whose output a RECV_F or RECV_B takes."""
    mb = recv.micro_batch or 0
    return (recv.stage - 1, "F", mb) if recv.kind is Kind.RECV_F else (recv.stage + 1, "B", mb)


def _compute_positions(schedule: PipelineSchedule) -> dict[_Node, tuple[int, int]]:
    return {_node(a): (rank, position) for rank, row in enumerate(schedule.actions)
            for position, a in enumerate(row) if a.is_compute}


def compute_order(schedule: PipelineSchedule) -> dict[tuple[int, int], tuple[int, int, int]]:
    """The compute actions' levels, as ``{(rank, position): (level, rank, position)}`` (sorting
    by it gives one global order): each action's level is minus the longest chain of actions that
    must follow it (its rank's later actions, the F of the next stage, the backward of the stage
    before, its own backward or W), so each comes as late as those rules allow, after everything
    it depends on, and actions of one level never depend on each other. Empty when the compute
    actions depend on each other in a circle (the schedule deadlocks)."""
    where = _compute_positions(schedule)
    successors: dict[tuple[int, int], list[tuple[int, int]]] = {at: [] for at in where.values()}
    waiting = dict.fromkeys(successors, 0)
    for rank, row in enumerate(schedule.actions):
        previous = None
        for position, action in enumerate(row):
            if not action.is_compute:
                continue
            me = (rank, position)
            stage, kind, mb = _node(action)
            first, last = schedule.stage_span(mb)
            needs = [] if previous is None else [previous]
            if kind == "F" and stage > first:
                needs.append(where.get((stage - 1, "F", mb)))
            elif kind == "B":
                needs.append(where.get((stage, "F", mb)))
                if stage < last:
                    needs.append(where.get((stage + 1, "B", mb)))
            elif kind == "W":
                needs.append(where.get((stage, "B", mb)))
            for need in {n for n in needs if n is not None and n != me}:
                successors[need].append(me)
                waiting[me] += 1
            previous = me
    ready = [at for at, count in waiting.items() if count == 0]
    topological: list[tuple[int, int]] = []
    while ready:
        at = ready.pop()
        topological.append(at)
        for after in successors[at]:
            waiting[after] -= 1
            if waiting[after] == 0:
                ready.append(after)
    if len(topological) != len(successors):
        return {}
    chain: dict[tuple[int, int], int] = {}
    for at in reversed(topological):
        chain[at] = 1 + max((chain[after] for after in successors[at]), default=-1)
    return {at: (-chain[at], at[0], at[1]) for at in topological}


# Stage offset from a point-to-point action's stage to its peer's: activations flow to the next
# stage, gradients to the previous one.
P2P_PEER_OFFSET = {Kind.SEND_F: 1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: 1}


def p2p_peer_stage(action: Action) -> int:
    """The stage on the other end of a SEND or RECV."""
    return action.stage + P2P_PEER_OFFSET[action.kind]


def parse_rows(rows: Sequence[str]) -> list[list[Action]]:
    """Parse medley text rows (as written by :meth:`PipelineSchedule.to_text`)."""
    return [[Action.parse(cell) for cell in row.split(",") if cell.strip()] for row in rows]


def with_default_collectives(schedule: PipelineSchedule) -> PipelineSchedule:
    """Make a bare schedule executable: P2P transfers if it has none, and, if it has no ZeRO
    collectives, the obvious ones per stage: UNSHARD before anything else, REDUCE_GRAD right
    after the stage's last backward, then RESHARD and OPTIM at the end of the rank's program.
    Schedules from ``medley.schedule.zero`` already carry their own and pass through unchanged."""
    rows = schedule.actions
    if not any(a.kind in COLLECTIVE_KINDS for row in rows for a in row):
        placed: list[list[Action]] = []
        for rank, row in enumerate(rows):
            stages = schedule.stages_of_rank(rank)
            out = [Action(s, Kind.UNSHARD) for s in stages]
            last_backward = {a.stage: i for i, a in enumerate(row) if a.kind in (Kind.W, Kind.BW)}
            for index, action in enumerate(row):
                out.append(action)
                if last_backward.get(action.stage) == index:
                    out.append(Action(action.stage, Kind.REDUCE_GRAD))
            out += [Action(s, Kind.RESHARD) for s in stages] + [Action(s, Kind.OPTIM) for s in stages]
            placed.append(out)
        schedule = schedule.with_actions(placed)
    if not any(a.kind in P2P_KINDS for row in schedule.actions for a in row):
        schedule = add_send_recv(schedule)
    return schedule
