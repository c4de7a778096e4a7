"""Split rules of :func:`medley.search.rules.builder.build`: layers per stage for a setting.

The plain splitters they use (:func:`medley.plan.layout.speed_split`, ``uniform_split``) belong
to the layout: ``medley simulate``'s inline split and ``--explain``'s even alternative use them too.
"""

from __future__ import annotations

from medley.plan.layout import speed_split, uniform_split
from medley.search.rules.builder import Setting
from medley.search.rules.sweep import StageEnds, bottleneck_split

# Bottleneck sweep bounds: the continuous optimum (every stage takes the share of the model its
# speed allows) is a lower bound on the bottleneck; the split is rarely more than a few layers'
# time above it, so the first search stops at 1.5x and only falls back to the slowest stage's
# whole-model time (with recomputation) when that is too tight.
SWEEP_LOW = 0.999
SWEEP_HIGH = 1.5
SWEEP_FALLBACK = 1.0001


def uniform(setting: Setting) -> tuple[int, ...]:
    """Split rule: every stage alike (what a homogeneous planner does)."""
    return uniform_split(setting.ctx.model, setting.num_stages)


def by_stage_capacity(setting: Setting) -> tuple[int, ...]:
    """Split rule: layers in proportion to each stage's compute capacity, the sum of its
    members' speeds (Metis splits the data inside a stage by speed)."""
    ctx, st = setting.ctx, setting.structure
    mbs = st.micro_batch_size
    names = [[(ctx.cluster.devices[st.assignment[r][k]].type.name, st.tp_of(k)) for k in range(st.pp)]
             for r in range(st.dp)]
    speed = {key: 1.0 / ctx.table(key[0], mbs, tp=key[1]).total[-1] for row in names for key in row}
    return speed_split(ctx.model, [sum(speed[names[r][k]] for r in range(st.dp)) for k in range(st.pp)])


def bottleneck(setting: Setting) -> tuple[int, ...] | None:
    """Split rule: the bottleneck sweep over the stages, each stage bounded by its devices' time
    and memory under the cheapest option first, then under any option."""
    ctx, st = setting.ctx, setting.structure
    pp = st.pp
    stage_types = [setting.stage_types(s) for s in range(pp)]
    num_layers = ctx.model.num_layers
    slowest = max(
        setting.table(s, t).time(0, num_layers, recompute=True) * c
        for s in range(pp)
        for t, c in stage_types[s]
    )
    # The continuous optimum (stage s takes the share of the model its speed allows) is a lower
    # bound on the bottleneck.
    ideal = 1.0 / sum(
        1.0 / max(setting.table(s, t).total[-1] * c for t, c in stage_types[s]) for s in range(pp)
    )
    for allowed in (setting.ladder[:1], setting.ladder):
        ends = StageEnds(setting, allowed)
        found = bottleneck_split(
            num_layers,
            pp,
            ends,
            lo=ideal * SWEEP_LOW,
            hi=ideal * SWEEP_HIGH,
            fallback_hi=slowest * SWEEP_FALLBACK,
            upper_end=ends.upper,
        )
        if found is not None:
            return found[0]
    return None


def interleaved_chunks(setting: Setting) -> tuple[int, ...] | None:
    """Split rule for interleaved 1F1B: chunk c runs on rank c % pp; the bottleneck sweep over the
    chunks in pipeline order, by time only (each rank's memory is the memory rule's)."""
    ctx, stages = setting.ctx, setting.num_stages
    chunk_types = [setting.stage_types(c) for c in range(stages)]
    slowest = max(setting.table(c, t).total[-1] * n for c in range(stages) for t, n in chunk_types[c])

    def stage_end(s: int, i: int, t: float) -> int:
        return min(setting.table(s, ty).max_end(i, t / n) for ty, n in chunk_types[s])

    found = bottleneck_split(ctx.model.num_layers, stages, stage_end, lo=0.0, hi=slowest * SWEEP_FALLBACK)
    return None if found is None else found[0]
