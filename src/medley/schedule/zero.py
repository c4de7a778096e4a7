"""ZIPPer's collective placement: ZeRO inside each pipeline stage, its collectives put where the
pipeline idles.

Every stage is its own ZeRO group: the devices that run that stage in each of the ``dp``
replicas. The pass inserts, per stage and in every replica's program:

* ``UNSHARD(s, b)``: all-gather of bucket ``b``'s weights (level 3 only), and ``RESHARD(s, b)``
  after its last use in the window;
* ``REDUCE_GRAD(s, b)``: the gradient reduction of bucket ``b`` (all-reduce at levels 0-1,
  reduce-scatter at 2-3) after its last weight gradient of the window;
* ``OPTIM(s, b)``: the (sharded) optimizer step of bucket ``b``.

Two policies. ``naive`` is what a plain FSDP wrapper does: level 3 gathers the whole stage before
every forward and every backward and frees it after; one reduction and the optimizer step after
the stage's last backward. ``bubble`` is the ZIPPer idea: the stage is split into layer buckets
so that bucket k's gather overlaps bucket k-1's compute; weights stay gathered across a window of
micro-batches (``gather_windows`` per step, 1 = the whole step) so the gathers land in the
stage's head bubble; each bucket's reduction starts as soon as its last weight gradient of the
window is done (the backward walks buckets last to first), which lands it in the tail bubble or,
for zero-bubble schedules, right after the deferred W that fills that bubble.

Every member of a DP group issues the same collectives in the same order even when replicas run
different numbers of micro-batches: windows are counted per step, not per micro-batch, and a
replica with fewer micro-batches pads the naive policy's per-micro-batch gathers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from medley.schedule.ir import COLLECTIVE_KINDS, Action, Kind, PipelineSchedule


class Placement(StrEnum):
    NAIVE = "naive"
    BUBBLE = "bubble"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageZero:
    """ZeRO settings of one pipeline stage.

    Attributes:
        level: ZeRO level 0..3.
        buckets: layer buckets the stage's collectives are split into (bubble policy).
        gather_windows: level 3: gather/reshard rounds per step; 1 keeps the weights gathered
            from first to last use in the step.
        grad_windows: levels 2-3: reduce-scatters per step; 1 accumulates a full gradient and
            reduces it once, more shard the accumulation (less memory, more traffic).
    """

    level: int
    buckets: int = 1
    gather_windows: int = 1
    grad_windows: int = 1

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO level must be 0..3, got {self.level}")
        for name in ("buckets", "gather_windows", "grad_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` items into ``parts`` contiguous groups, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def bucket_layers(stage_layers: Sequence[int], zero: Sequence[StageZero], policy: Placement) -> dict:
    """Layers per bucket for every stage (one bucket under the naive policy)."""
    out: dict[int, tuple[int, ...]] = {}
    for stage, (layers, setting) in enumerate(zip(stage_layers, zero, strict=True)):
        count = 1 if policy is Placement.NAIVE else max(1, min(setting.buckets, layers))
        out[stage] = tuple(split_evenly(layers, count))
    return out


def _windows(items: list[int], count: int) -> list[list[int]]:
    sizes = split_evenly(len(items), count)
    out, start = [], 0
    for size in sizes:
        out.append(items[start : start + size])
        start += size
    return out


def _rank_plan(
    row: list[Action], stage: int, setting: StageZero, nbuckets: int, policy: Placement
) -> tuple[dict[int, list[Action]], dict[int, list[Action]]]:
    """Collectives of ``stage`` on one rank: actions to insert before / after compute indices."""
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    uses = [i for i, a in enumerate(row) if a.is_compute and a.stage == stage]
    grads = [i for i in uses if row[i].kind in (Kind.W, Kind.BW)]
    buckets: list[int | None] = [None] if nbuckets == 1 else list(range(nbuckets))
    if setting.level == 3:
        windows = [[i] for i in uses] if policy is Placement.NAIVE else _windows(uses, setting.gather_windows)
        last_use = uses[0]
        for window in windows:
            gathers = [Action(stage, Kind.UNSHARD, bucket=b) for b in buckets]
            frees = [Action(stage, Kind.RESHARD, bucket=b) for b in buckets]
            if window:
                before.setdefault(window[0], []).extend(gathers)
                after.setdefault(window[-1], []).extend(frees)
                last_use = window[-1]
            else:  # fewer uses than windows: an empty round keeps the DP group's sequence equal
                after.setdefault(last_use, []).extend(gathers + frees)
    grad_windows = setting.grad_windows if (setting.level >= 2 and policy is Placement.BUBBLE) else 1
    reduce_order = list(reversed(buckets))  # the backward finishes the last bucket first
    last_grad = grads[0]
    for window in _windows(grads, grad_windows):
        last_grad = window[-1] if window else last_grad
        after.setdefault(last_grad, []).extend(
            Action(stage, Kind.REDUCE_GRAD, bucket=b) for b in reduce_order
        )
    after.setdefault(grads[-1], []).extend(Action(stage, Kind.OPTIM, bucket=b) for b in reduce_order)
    return before, after


def _pad_naive_gathers(rows: list[list[Action]], stage: int, target: int, nbuckets: int) -> None:
    """Add UNSHARD/RESHARD pairs before the stage's first REDUCE_GRAD until ``target`` pairs."""
    for row in rows:
        have = sum(1 for a in row if a.kind is Kind.UNSHARD and a.stage == stage)
        if have >= target:
            continue
        at = next(i for i, a in enumerate(row) if a.kind is Kind.REDUCE_GRAD and a.stage == stage)
        bucket = None if nbuckets == 1 else 0
        pad = [
            Action(stage, k, bucket=bucket)
            for _ in range(target - have)
            for k in (Kind.UNSHARD, Kind.RESHARD)
        ]
        row[at:at] = pad


def place_collectives(
    schedules: Sequence[PipelineSchedule],
    zero: Sequence[StageZero],
    *,
    stage_layers: Sequence[int],
    policy: Placement | str = Placement.BUBBLE,
) -> list[PipelineSchedule]:
    """Insert the ZeRO collectives of every stage into every replica's schedule.

    ``schedules`` are the replicas' programs (compute-only or lowered; same stages and
    stage-to-rank map, micro-batch counts may differ). ``zero[s]`` and ``stage_layers[s]`` are
    per global stage. Existing collectives are removed first, so the pass can be re-run.
    """
    policy = Placement(policy)
    first = schedules[0]
    if len(zero) != first.num_stages or len(stage_layers) != first.num_stages:
        raise ValueError(
            f"need one ZeRO setting and one layer count per stage ({first.num_stages}), "
            f"got {len(zero)} and {len(stage_layers)}"
        )
    for sched in schedules[1:]:
        if sched.stage_to_rank != first.stage_to_rank:
            raise ValueError("all replicas must place stages on pipeline ranks the same way")
    buckets = bucket_layers(stage_layers, zero, policy)
    out = []
    for sched in schedules:
        rows = []
        for rank, row in enumerate(sched.actions):
            base = [a for a in row if a.kind not in COLLECTIVE_KINDS]
            before: dict[int, list[Action]] = {}
            after: dict[int, list[Action]] = {}
            for stage in sched.stages_of_rank(rank):
                b, a = _rank_plan(base, stage, zero[stage], len(buckets[stage]), policy)
                for key, acts in b.items():
                    before.setdefault(key, []).extend(acts)
                for key, acts in a.items():
                    after.setdefault(key, []).extend(acts)
            rows.append(_merge(base, before, after))
        placed = sched.with_actions(rows)
        placed.bucket_layers = dict(buckets)
        out.append(placed)
    if policy is Placement.NAIVE:
        for stage, setting in enumerate(zero):
            if setting.level == 3:
                rank = first.stage_to_rank[stage]
                most = max(
                    sum(1 for a in s.actions[rank] if a.kind is Kind.UNSHARD and a.stage == stage)
                    for s in out
                )
                _pad_naive_gathers([s.actions[rank] for s in out], stage, most, len(buckets[stage]))
    check_dp_consistency(out)
    return out


def _merge(base: list[Action], before: dict, after: dict) -> list[Action]:
    merged: list[Action] = []
    for i, action in enumerate(base):
        merged.extend(before.get(i, ()))
        merged.append(action)
        merged.extend(after.get(i, ()))
    merged.extend(before.get(len(base), ()))
    return merged


def collective_sequence(schedule: PipelineSchedule, rank: int) -> list[tuple[Kind, int, int | None]]:
    return [(a.kind, a.stage, a.bucket) for a in schedule.actions[rank] if a.kind in COLLECTIVE_KINDS]


class CollectiveMismatchError(ValueError):
    """Members of a DP group would issue different collectives: a hang at run time."""


def check_dp_consistency(schedules: Sequence[PipelineSchedule]) -> None:
    """Every member of every stage's DP group issues the same collectives in the same order.

    Members are the same pipeline rank in each replica; since a rank may hold several stages,
    the whole merged sequence of the rank must agree, not only each stage's.
    """
    reference = schedules[0]
    for rank in range(reference.num_ranks):
        expected = collective_sequence(reference, rank)
        for replica, sched in enumerate(schedules[1:], start=1):
            got = collective_sequence(sched, rank)
            if got != expected:
                at = next(
                    (i for i, (x, y) in enumerate(zip(expected, got, strict=False)) if x != y),
                    min(len(got), len(expected)),
                )
                raise CollectiveMismatchError(
                    f"pipeline rank {rank}: replica {replica} issues collective #{at} "
                    f"{got[at] if at < len(got) else 'nothing'} where replica 0 issues "
                    f"{expected[at] if at < len(expected) else 'nothing'}; the DP group would hang"
                )
