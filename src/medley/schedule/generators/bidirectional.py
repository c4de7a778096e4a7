"""Bidirectional pipelines (Chimera, Li & Hoefler SC'21; MixPipe, DAC'23).

Two pipelines run over the same p ranks in opposite directions. The *down* pipeline is stages
0..p-1 on ranks 0..p-1; the *up* pipeline is stages p..2p-1 on ranks p-1..0 (stage p+j on rank
p-1-j), so ``stage_to_rank`` is the V mapping. Micro-batches 0..d-1 flow down, d..m-1 flow up
(``micro_batch_stages`` records each one's span); ``d = down_micro_batches`` is the knob that
sets how many enter each direction.

Weight duplication: up stage p+j holds the same layers as down stage j (model part j), so rank r
keeps two copies of the weights, part r (down) and part p-1-r (up): twice the parameter and
gradient memory of 1F1B, and before the optimizer step the two copies' gradients must be summed
(an all-reduce between ranks r and p-1-r, on top of ordinary data parallelism). Costs and memory
of stage p+j are those of model part j.

The order on each rank comes from the greedy list scheduler: ready backwards first, then ready
forwards of either direction (lower micro-batch first), each direction keeping 1F1B's warm-up
depth (p - position in its pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.schedule.generators.classic import check_sizes, one_f_one_b_depth
from medley.schedule.generators.list_scheduler import check_costs, check_limits, list_schedule
from medley.schedule.ir import PipelineSchedule, v_stage_to_rank


def bidirectional(
    *,
    pp: int,
    micro_batches: int,
    down_micro_batches: int | None = None,
    stage_costs: Sequence[Sequence[float]] | None = None,
    memory_limit: Sequence[int] | None = None,
) -> PipelineSchedule:
    """Chimera-like schedule with ``down_micro_batches`` (default: half, rounded up) going down.

    ``stage_costs`` has one (F, B, W) triple per model part (p) or per global stage (2p).
    ``memory_limit[r]`` caps the micro-batches (of one stage) rank r holds over both directions.
    """
    check_sizes(pp, micro_batches)
    down = (micro_batches + 1) // 2 if down_micro_batches is None else int(down_micro_batches)
    if not 0 <= down <= micro_batches:
        raise ValueError(f"down_micro_batches must be in 0..{micro_batches}, got {down}")
    up = micro_batches - down
    costs = stage_costs
    if costs is not None and len(costs) == pp:
        costs = list(costs) + list(costs)  # up stage p+j runs model part j
    spans = tuple([(0, pp - 1)] * down + [(pp, 2 * pp - 1)] * up)
    warmup = ([one_f_one_b_depth(pp, s, down) for s in range(pp)]
              + [one_f_one_b_depth(pp, j, up) for j in range(pp)])
    unlimited = [2 * micro_batches] * pp
    memory = check_limits(memory_limit, unlimited, "memory_limit")
    s2r = v_stage_to_rank(pp)
    actions = list_schedule(
        stage_to_rank=s2r,
        spans=spans,
        costs=check_costs(costs, 2 * pp),
        split_backward=False,
        stage_limit=[max(w, 1) for w in warmup],
        rank_limit=memory,
    )
    knobs: dict[str, int | tuple[int, ...]] = {"down_micro_batches": down}
    if memory_limit is not None:
        knobs["memory_limit"] = tuple(memory)
    return PipelineSchedule(
        family="bidirectional", num_stages=2 * pp, num_micro_batches=micro_batches,
        stage_to_rank=s2r, actions=actions, knobs=knobs, micro_batch_stages=spans,
    )
