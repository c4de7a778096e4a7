"""Fixed-pattern schedules: GPipe, 1F1B, heterogeneity-aware 1F1B and interleaved 1F1B.

Each stage's order depends only on (pp, micro-batches, knobs), never on costs; all use the fused
backward ``BW``.
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.schedule.ir import BW, Action, F, PipelineSchedule, loop_stage_to_rank


def check_sizes(pp: int, micro_batches: int) -> None:
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")


def gpipe(*, pp: int, micro_batches: int) -> PipelineSchedule:
    """Fill-drain: every forward, then every backward; stage s holds all m micro-batches."""
    check_sizes(pp, micro_batches)
    mbs = range(micro_batches)
    actions = [[F(s, i) for i in mbs] + [BW(s, i) for i in mbs] for s in range(pp)]
    return PipelineSchedule(
        family="gpipe", num_stages=pp, num_micro_batches=micro_batches,
        stage_to_rank=loop_stage_to_rank(pp), actions=actions,
    )


def one_f_one_b_depth(pp: int, stage: int, micro_batches: int) -> int:
    """1F1B's in-flight depth: stage ``stage`` of ``pp`` runs ``pp - stage`` forwards before its
    first backward (all ``micro_batches`` when there are fewer), and holds at most that many
    micro-batches' activations. ZB-H1 keeps it; the planner's memory estimates read it here."""
    return min(pp - stage, micro_batches)


def _one_f_one_b_row(stage: int, depth: int, micro_batches: int) -> list[Action]:
    """``depth`` forwards, then alternate one backward and one forward, then drain."""
    depth = min(depth, micro_batches)
    row = [F(stage, i) for i in range(depth)]
    for i in range(micro_batches - depth):
        row += [BW(stage, i), F(stage, depth + i)]
    row += [BW(stage, i) for i in range(micro_batches - depth, micro_batches)]
    return row


def one_f_one_b(*, pp: int, micro_batches: int) -> PipelineSchedule:
    """PipeDream-flush / DAPPLE: stage s runs p-s forwards before its first backward, so it never
    holds more than min(p-s, m) micro-batches of activations (:func:`one_f_one_b_depth`)."""
    check_sizes(pp, micro_batches)
    actions = [_one_f_one_b_row(s, one_f_one_b_depth(pp, s, micro_batches), micro_batches)
               for s in range(pp)]
    return PipelineSchedule(
        family="1f1b", num_stages=pp, num_micro_batches=micro_batches,
        stage_to_rank=loop_stage_to_rank(pp), actions=actions,
    )


def hetero_one_f_one_b(
    *, pp: int, micro_batches: int, warmup: Sequence[int] | None = None
) -> PipelineSchedule:
    """1F1B whose in-flight depth is chosen per stage.

    ``warmup[s]`` is the number of forwards stage s runs before its first backward (its peak
    in-flight micro-batches); 1F1B is ``p - s``. A stage in front of a slow link or device gets a
    larger depth so that it keeps working while the slow part drains. Depths must not increase
    along the pipeline: stage s+1 consumes stage s's first ``warmup[s+1]`` forwards before it can
    send back any gradient, so a shallower stage s would wait on itself (deadlock).
    """
    check_sizes(pp, micro_batches)
    depths = tuple(range(pp, 0, -1)) if warmup is None else tuple(int(d) for d in warmup)
    if len(depths) != pp:
        raise ValueError(f"warmup needs one depth per stage ({pp}), got {len(depths)}: {depths}")
    if any(d < 1 for d in depths):
        raise ValueError(f"warmup depths must be >= 1, got {depths}")
    clipped = [min(d, micro_batches) for d in depths]
    for s in range(pp - 1):
        if clipped[s] < clipped[s + 1]:
            raise ValueError(
                f"warmup depth of stage {s} ({depths[s]}) is below stage {s + 1}'s ({depths[s + 1]}); "
                "depths must be non-increasing along the pipeline or the schedule deadlocks"
            )
    actions = [_one_f_one_b_row(s, depths[s], micro_batches) for s in range(pp)]
    return PipelineSchedule(
        family="hetero-1f1b", num_stages=pp, num_micro_batches=micro_batches,
        stage_to_rank=loop_stage_to_rank(pp), actions=actions, knobs={"warmup": depths},
    )


def interleaved(*, pp: int, micro_batches: int, virtual_stages: int = 2) -> PipelineSchedule:
    """Megatron's interleaved 1F1B: rank r holds chunks r, r+p, ..., r+(v-1)p.

    Micro-batches go through the chunks in rounds of g >= p micro-batches: a rank runs a round's
    forwards on chunk 0, then on chunk 1, and so on; backwards walk the chunks in reverse. Rank r
    warms up with 2(p-r-1) + (v-1)g chunk forwards, then alternates. When p does not divide m,
    the first m mod rounds rounds take one extra micro-batch (as torch does, rounds of at least p;
    a short last round would deadlock).
    """
    check_sizes(pp, micro_batches)
    v = virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {v}")
    rounds = max(1, micro_batches // pp)
    sizes = [micro_batches // rounds + (1 if k < micro_batches % rounds else 0) for k in range(rounds)]
    starts = [sum(sizes[:k]) for k in range(rounds)]
    groups = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    actions: list[list[Action]] = []
    for rank in range(pp):
        forwards = [F(c * pp + rank, i) for grp in groups for c in range(v) for i in grp]
        backwards = [BW(c * pp + rank, i) for grp in groups for c in reversed(range(v)) for i in grp]
        total = len(forwards)
        depth = min(total, 2 * (pp - rank - 1) + (v - 1) * sizes[0] + 1)
        row = forwards[:depth]
        for k in range(total - depth):
            row += [backwards[k], forwards[depth + k]]
        row += backwards[total - depth:]
        actions.append(row)
    return PipelineSchedule(
        family="interleaved", num_stages=pp * v, num_micro_batches=micro_batches,
        stage_to_rank=loop_stage_to_rank(pp, v), actions=actions, knobs={"virtual_stages": v},
    )
