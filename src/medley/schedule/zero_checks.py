"""The rules a schedule with ZeRO collectives keeps (checked after :mod:`medley.schedule.zero`
places them, and by the runtime before it runs a schedule): every member of a DP group issues the
same collectives in the same order, and each stage's gathers, reductions and optimizer steps come
in the order its level needs."""

from __future__ import annotations

from collections.abc import Sequence

from medley.cost.zero_levels import zero_level
from medley.schedule.ir import COLLECTIVE_KINDS, Action, Kind, PipelineSchedule
from medley.schedule.zero_settings import StageZero


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


def _fail(rank: int, action: Action, rule: str) -> None:
    raise CollectiveMismatchError(f"rank {rank}, action {action}: {rule}")


def check_zero_placement(schedule: PipelineSchedule, zero: Sequence[StageZero]) -> None:
    """Check one replica's collectives against the rules the runtime relies on.

    Level-3 compute runs only while every bucket of its stage is gathered; gathers and frees
    alternate; a level 1-2 gather follows its bucket's optimizer step; no weight gradient is
    produced after a stage's last reduction; the optimizer step of a bucket follows that
    bucket's last reduction. Raises :class:`CollectiveMismatchError` naming the rank, the
    action and the rule.
    """
    for rank, row in enumerate(schedule.actions):
        gathered: set[tuple[int, int | None]] = set()
        reduced_after_last_grad: dict[tuple[int, int | None], bool] = {}
        stepped: dict[tuple[int, int | None], bool] = {}
        clipping, clipped = any(a.kind is Kind.CLIP for a in row), False
        for action in row:
            key = (action.stage, action.bucket)
            level = zero[action.stage].level
            meaning = zero_level(level)

            if action.kind is Kind.UNSHARD and meaning.gathers_after_step:
                if not stepped.get(key):
                    _fail(rank, action, f"ZeRO-{level} weight gather before the bucket's optimizer step")
            elif action.kind is Kind.UNSHARD:
                if not meaning.gathers_for_compute:
                    _fail(rank, action, "UNSHARD on a ZeRO-0 stage (its weights are never sharded)")
                if key in gathered:
                    _fail(rank, action, "gathered twice without a RESHARD in between")
                gathered.add(key)
            elif action.kind is Kind.RESHARD:
                if key not in gathered:
                    _fail(rank, action, "RESHARD of weights that are not gathered")
                gathered.discard(key)
            elif action.kind is Kind.REDUCE_GRAD:
                reduced_after_last_grad[key] = True
            elif action.kind is Kind.CLIP:
                clipped = True
            elif action.kind is Kind.OPTIM:
                if clipping and not clipped:
                    _fail(rank, action, "optimizer step before the gradient-norm CLIP")
                if not reduced_after_last_grad.get(key):
                    _fail(rank, action, "optimizer step before the bucket's gradient reduction")
                stepped[key] = True
            elif action.is_compute:
                buckets = schedule.bucket_layers.get(action.stage, (0,))
                keys = (
                    [(action.stage, None)]
                    if len(buckets) == 1
                    else [(action.stage, b) for b in range(len(buckets))]
                )
                if meaning.gathers_for_compute and not all(k in gathered for k in keys):
                    _fail(rank, action, "compute on a ZeRO-3 stage whose weights are not gathered")
                if action.kind in (Kind.W, Kind.BW):
                    for k in keys:
                        reduced_after_last_grad[k] = False
        leftover = [k for k, done in reduced_after_last_grad.items() if not done]
        if leftover:
            raise CollectiveMismatchError(
                f"rank {rank}: stage {leftover[0][0]} produces weight gradients after its last REDUCE_GRAD"
            )
        if gathered:
            raise CollectiveMismatchError(
                f"rank {rank}: weights of {sorted(gathered, key=str)} still gathered at the end"
            )
