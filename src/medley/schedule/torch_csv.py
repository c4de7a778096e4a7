"""Round trip with torch.distributed.pipelining's action CSV (``_dump_csv`` / ``_load_csv``).

One CSV row per rank, one action per cell, in torch's names: ``0F0`` forward, ``1I0`` input-grad
backward (our ``B``), ``1W0`` weight-grad backward, ``1B0`` fused full backward (our ``BW``),
``2SEND_F0``/``RECV_F``/``SEND_B``/``RECV_B``, and ``0UNSHARD``/``0RESHARD``/``0REDUCE_GRAD``.
Empty cells (torch's idle ``None`` slots) are skipped on reading; torch's ``OVERLAP_F_B``
container ``(0F3;1B2)OVERLAP_F_B`` is read as its sub-actions in order.

Not expressible in torch, so :func:`to_torch_rows` rejects them unless ``drop_unsupported``:
``OPTIM`` (torch steps the optimizer outside the schedule) and layer-bucketed collectives
(``0UNSHARD@1``; torch unshards whole stages). A bidirectional schedule's rows are written fine,
but torch's own loader requires every micro-batch to visit every stage; :func:`split_directions`
gives the two one-direction schedules that torch accepts, one runtime each.

This module does not import torch.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from medley.fileio import write_atomically
from medley.schedule.ir import COMPUTE_KINDS, Action, Kind, PipelineSchedule
from medley.schedule.validate import ScheduleError

_TO_TORCH = {
    Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B",
    Kind.SEND_F: "SEND_F", Kind.RECV_F: "RECV_F", Kind.SEND_B: "SEND_B", Kind.RECV_B: "RECV_B",
    Kind.UNSHARD: "UNSHARD", Kind.RESHARD: "RESHARD", Kind.REDUCE_GRAD: "REDUCE_GRAD",
}
_FROM_TORCH = {name: kind for kind, name in _TO_TORCH.items()}
_ACTION = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|I|B|W)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


def torch_name(action: Action) -> str:
    """torch's string for ``action``; ScheduleError if torch has no such action."""
    if action.kind not in _TO_TORCH:
        raise ScheduleError(f"action {action}: torch has no {action.kind} (use drop_unsupported=True)")
    if action.bucket is not None:
        raise ScheduleError(f"action {action}: torch collectives act on whole stages, not layer buckets")
    mb = "" if action.micro_batch is None else str(action.micro_batch)
    return f"{action.stage}{_TO_TORCH[action.kind]}{mb}"


def to_torch_rows(schedule: PipelineSchedule, *, drop_unsupported: bool = False) -> list[list[str]]:
    """One list of torch action strings per rank.

    ``drop_unsupported`` silently drops OPTIM and bucketed collectives instead of raising.
    """
    rows = []
    for row in schedule.actions:
        cells = []
        for action in row:
            if drop_unsupported and (action.kind not in _TO_TORCH or action.bucket is not None):
                continue
            cells.append(torch_name(action))
        rows.append(cells)
    return rows


def write_torch_csv(schedule: PipelineSchedule, path: str | Path, *, drop_unsupported: bool = False) -> None:
    text = io.StringIO(newline="")
    csv.writer(text).writerows(to_torch_rows(schedule, drop_unsupported=drop_unsupported))
    write_atomically(Path(path), text.getvalue())


def parse_torch_action(text: str) -> list[Action]:
    """Parse one torch cell; an OVERLAP_F_B container yields its sub-actions, an empty cell none."""
    text = text.strip()
    if not text:
        return []
    if overlap := _OVERLAP.fullmatch(text):
        return [a for part in overlap.group(1).split(";") for a in parse_torch_action(part)]
    match = _ACTION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a torch pipeline action (expected e.g. '2F0', '1I3', '0SEND_F1')")
    stage, name, mb = match.groups()
    return [Action(int(stage), _FROM_TORCH[name], int(mb) if mb else None)]


def from_torch_rows(
    rows: list[list[str]],
    *,
    num_micro_batches: int | None = None,
    family: str = "torch",
    micro_batch_stages: tuple[tuple[int, int], ...] = (),
    stage_to_rank: tuple[int, ...] | None = None,
) -> PipelineSchedule:
    """Build a schedule from torch action strings. The stage-to-rank map is read off where each
    stage's compute runs unless ``stage_to_rank`` is given (needed when a stage has no action, as
    in a bidirectional schedule with an empty direction); give ``micro_batch_stages`` for a
    bidirectional schedule."""
    actions = [[a for cell in row for a in parse_torch_action(cell)] for row in rows]
    owner: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for action in row:
            if action.kind in COMPUTE_KINDS and owner.setdefault(action.stage, rank) != rank:
                raise ScheduleError(
                    f"rank {rank}, action {action}: stage {action.stage} "
                    f"also computes on rank {owner[action.stage]}"
                )
    if stage_to_rank is not None:
        for stage, rank in owner.items():
            if stage >= len(stage_to_rank) or stage_to_rank[stage] != rank:
                raise ScheduleError(f"rank {rank}: stage {stage} computes here, not where stage_to_rank says")
        owner = dict(enumerate(stage_to_rank))
    stages = [a.stage for row in actions for a in row] + list(owner)
    num_stages = max(stages, default=-1) + 1
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ScheduleError(f"stages {missing} have no compute action, so their rank is unknown")
    if num_micro_batches is None:
        indices = [a.micro_batch for row in actions for a in row if a.micro_batch is not None]
        num_micro_batches = 1 + max(indices, default=-1)
    return PipelineSchedule(
        family=family,
        num_stages=num_stages,
        num_micro_batches=num_micro_batches,
        stage_to_rank=tuple(owner[s] for s in range(num_stages)),
        actions=actions,
        micro_batch_stages=micro_batch_stages,
    )


def read_torch_csv(
    path: str | Path,
    *,
    num_micro_batches: int | None = None,
    family: str = "torch",
    micro_batch_stages: tuple[tuple[int, int], ...] = (),
    stage_to_rank: tuple[int, ...] | None = None,
) -> PipelineSchedule:
    """Read a CSV written by torch's ``_dump_csv`` (either format) or by :func:`write_torch_csv`."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    try:
        return from_torch_rows(
            rows, num_micro_batches=num_micro_batches, family=family,
            micro_batch_stages=micro_batch_stages, stage_to_rank=stage_to_rank,
        )
    except ValueError as err:
        raise type(err)(f"{path}: {err}") from None


def split_directions(schedule: PipelineSchedule) -> list[PipelineSchedule]:
    """The one-direction schedules of a bidirectional schedule, each renumbered so that its
    micro-batches run 0.. and its stages 0..p-1 from its first stage; other schedules unchanged.
    Each part is what one torch runtime can execute (the parts' interleaving on a rank is lost)."""
    if not schedule.micro_batch_stages:
        return [schedule]
    spans = sorted(set(schedule.micro_batch_stages))
    parts = []
    for first, last in spans:
        mbs = [mb for mb, span in enumerate(schedule.micro_batch_stages) if span == (first, last)]
        renumber = {mb: i for i, mb in enumerate(mbs)}
        rows = [
            [Action(a.stage - first, a.kind, renumber[a.micro_batch]) for a in row
             if a.micro_batch in renumber and first <= a.stage <= last]
            for row in schedule.actions
        ]
        parts.append(PipelineSchedule(
            family=schedule.family, num_stages=last - first + 1, num_micro_batches=len(mbs),
            stage_to_rank=schedule.stage_to_rank[first:last + 1], actions=rows,
        ))
    return parts
