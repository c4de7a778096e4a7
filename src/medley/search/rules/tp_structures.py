"""Which tensor-parallel groups a device pool offers the search, and structures whose pipeline
ranks take different degrees (the heterogeneous case: more TP on slower or smaller devices).

A TP group is ``tp`` consecutive device ids on one node, of one device type
(:func:`medley.plan.layout.check_tp`); a structure's ``assignment`` holds each group's first
device. Uniform degrees are enumerated by :class:`medley.search.rules.candidates.Estimator` over every
pool; :func:`mixed_structures` adds, for pools of several types, degrees per type that bring the
groups' speeds together: with base degree ``t0`` on the fastest type, a type ``r`` times slower
gets ``t0`` x the power of two nearest ``r`` (at most 8 and what its nodes hold). Pipeline rank
k's DP group is the k-th run of ``dp`` groups, fastest type first, so every rank's replicas share
one type and degree; each type contributes whole runs (its groups beyond a multiple of dp sit out).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from medley.plan.layout import TP_DEGREES, tp_undivided
from medley.search.estimate.context import PlanContext
from medley.search.space import Structure

MIXED_BASES = (1, 2, 4)
"""Degrees of the fastest type in the mixed structures."""
MIXED_DP = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Replica counts tried for a mixed structure (its pipeline depth follows from them)."""


def tp_degrees(ctx: PlanContext, devices: Sequence[int]) -> tuple[int, ...]:
    """Degrees of :data:`~medley.plan.layout.TP_DEGREES` the model's heads, KV heads and MLP width
    divide and some node of the pool can hold a group of (1 always)."""
    return tuple(t for t in TP_DEGREES
                 if tp_undivided(ctx.model, t) is None and (t == 1 or tp_groups(ctx, devices, t)))


def tp_groups(ctx: PlanContext, devices: Sequence[int], tp: int) -> list[int]:
    """First devices of the TP groups of ``devices``: runs of ``tp`` consecutive ids on one node
    and of one type (devices left over on a node are not used at this degree)."""
    if tp == 1:
        return list(devices)
    cluster = ctx.cluster
    chosen = set(devices)
    out: list[int] = []
    taken: set[int] = set()
    for first in sorted(devices):
        if first in taken:
            continue
        group = range(first, first + tp)
        if all(d in chosen and d not in taken for d in group) and cluster.one_node_one_type(group):
            out.append(first)
            taken.update(group)
    return out


def mixed_degrees(ctx: PlanContext, devices: Sequence[int]) -> list[dict[str, int]]:
    """Per-type degrees for each base in :data:`MIXED_BASES` (the module docstring), distinct and
    not uniform."""
    names = sorted({ctx.cluster.devices[d].type.name for d in devices})
    if len(names) < 2:
        return []
    time = {t: ctx.table(t, 1).total[-1] for t in names}
    fastest = min(time.values())
    of_type = {t: [x for x in devices if ctx.cluster.devices[x].type.name == t] for t in names}
    allowed = {t: tp_degrees(ctx, of_type[t]) for t in names}
    out: list[dict[str, int]] = []
    for base in MIXED_BASES:
        degrees = {}
        for t in names:
            want = base * 2 ** round(math.log2(time[t] / fastest))
            fits = [d for d in allowed[t] if d <= want]
            degrees[t] = max(fits) if fits else 1
        if len(set(degrees.values())) > 1 and degrees not in out:
            out.append(degrees)
    return out


def mixed_structures(
    ctx: PlanContext, pool: str, devices: Sequence[int], *, max_pp: int, micro_batch_sizes: Sequence[int],
    type_order: Sequence[str] | None = None, strategy: str = "stage-major",
) -> Iterator[Structure]:
    """Structures of the pool whose pipeline ranks take the degrees of :func:`mixed_degrees`; the
    types' runs follow ``type_order`` (default: fastest at its degree first)."""
    cluster = ctx.cluster
    for degrees in mixed_degrees(ctx, devices):
        time = {t: ctx.table(t, 1, tp=d).total[-1] for t, d in degrees.items()}
        by_type = list(type_order) if type_order else sorted(degrees, key=lambda t: (time[t], t))
        units = {t: tp_groups(ctx, [d for d in devices if cluster.devices[d].type.name == t], degrees[t])
                 for t in by_type}
        for mbs in micro_batch_sizes:
            if ctx.global_batch % mbs:
                continue
            for dp in MIXED_DP:
                if dp > ctx.global_batch // mbs:
                    break
                runs = [(t, len(units[t]) // dp) for t in by_type]
                pp = sum(n for _, n in runs)
                if not 1 <= pp <= min(max_pp, ctx.model.num_layers) or sum(n > 0 for _, n in runs) < 2:
                    continue  # a single type's run is a uniform structure, enumerated already
                order = [u for t, n in runs for u in units[t][: n * dp]]
                tp = tuple(degrees[t] for t, n in runs for _ in range(n))
                assignment = ctx.assign(order, pp, dp, "stage-major")
                yield Structure(pool=pool, strategy=strategy, pp=pp, dp=dp, assignment=assignment,
                                micro_batch_size=mbs, tp=tp)
