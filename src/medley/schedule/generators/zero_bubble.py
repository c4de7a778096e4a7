"""Zero-bubble schedules (Qi et al., ICLR'24): the backward is split into B (input gradient) and W
(weight gradient), and W is deferred into time the rank would otherwise idle.

- ``zb-h1`` is the paper's fixed pattern: 1F1B's warm-up and peak memory (p micro-batches per
  rank, counted from F until W), each stage deferring its Ws by s places so that they fill the
  cooldown; with equal F, B and W times its bubble is a third of 1F1B's.
- ``zb-h2`` comes from the greedy list scheduler (``list_scheduler``) with per-stage costs:
  up to 2(p-s)-1 forwards waiting for their B on stage s, enough warm-up to cover the wait for
  the first B, and 2p-1 micro-batches of memory per rank for deferred Ws (``memory_limit``
  overrides it). The greedy is a heuristic: with equal times it reaches (p-1)·T bubble, not the
  paper's zero (which also needs optimizer post-validation).
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.schedule.generators.classic import check_sizes, one_f_one_b_depth
from medley.schedule.generators.list_scheduler import check_costs, check_limits, list_schedule
from medley.schedule.ir import Action, B, F, PipelineSchedule, W, loop_stage_to_rank


def _zero_bubble(
    family: str,
    pending_backward: list[int],
    default_memory: list[int],
    pp: int,
    micro_batches: int,
    stage_costs: Sequence[Sequence[float]] | None,
    memory_limit: Sequence[int] | None,
) -> PipelineSchedule:
    memory = check_limits(memory_limit, default_memory, "memory_limit")
    s2r = loop_stage_to_rank(pp)
    actions = list_schedule(
        stage_to_rank=s2r,
        spans=[(0, pp - 1)] * micro_batches,
        costs=check_costs(stage_costs, pp),
        split_backward=True,
        stage_limit=pending_backward,
        rank_limit=memory,
    )
    knobs: dict[str, int | tuple[int, ...]] = {}
    if memory_limit is not None:
        knobs["memory_limit"] = tuple(memory)
    return PipelineSchedule(
        family=family, num_stages=pp, num_micro_batches=micro_batches,
        stage_to_rank=s2r, actions=actions, knobs=knobs,
    )


def zb_h1(*, pp: int, micro_batches: int) -> PipelineSchedule:
    """ZB-H1, the paper's hand-made pattern: 1F1B's warm-up (p-s forwards before the first B),
    then B, the W deferred by s places, F; the deferred Ws fill the cooldown. Every rank holds at
    most p micro-batches (1F1B's peak, counted until W); with equal F, B and W times the bubble
    is (p-1)(F+B-W), a third of 1F1B's."""
    check_sizes(pp, micro_batches)
    actions: list[list[Action]] = []
    for s in range(pp):
        depth = one_f_one_b_depth(pp, s, micro_batches)
        row = [F(s, i) for i in range(depth)]
        next_w = 0
        for i in range(micro_batches):
            row.append(B(s, i))
            if i - next_w >= s:
                row.append(W(s, next_w))
                next_w += 1
            if depth + i < micro_batches:
                row.append(F(s, depth + i))
        row += [W(s, j) for j in range(next_w, micro_batches)]
        actions.append(row)
    return PipelineSchedule(
        family="zb-h1", num_stages=pp, num_micro_batches=micro_batches,
        stage_to_rank=loop_stage_to_rank(pp), actions=actions,
    )


def zb_h2(
    *,
    pp: int,
    micro_batches: int,
    stage_costs: Sequence[Sequence[float]] | None = None,
    memory_limit: Sequence[int] | None = None,
) -> PipelineSchedule:
    """ZB-H2 from the greedy list scheduler: up to 2(p-s)-1 forwards in flight on stage s, so
    warm-up covers the wait for the first B, and 2p-1 micro-batches of memory per rank."""
    check_sizes(pp, micro_batches)
    warmup = [min(2 * (pp - s) - 1, micro_batches) for s in range(pp)]
    memory = [min(2 * pp - 1, micro_batches)] * pp
    return _zero_bubble("zb-h2", warmup, memory, pp, micro_batches, stage_costs, memory_limit)
