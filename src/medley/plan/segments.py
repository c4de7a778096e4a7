"""Sync segments: what ties a plan's replicas together, defined once for the cost model, the
simulator and the runtime.

A plan is one or more *replica groups* (:class:`~medley.plan.layout.PlanLayout` each: alike
replicas with their own depth, split, TP degrees, schedule, micro-batches, ZeRO and recomputation
per stage). Every replica holds every layer once, so each layer's gradients are summed (ZeRO 0-2)
or its parameters sharded (ZeRO-3) over one member per replica. A *sync segment* is a maximal range
of layers that lies inside one stage of every replica: the cuts are every group's stage
boundaries. In a plan of alike replicas the segments are the stages. Each segment is one ZeRO group
per TP rank (its holders' TP rank j, in global replica order), cut into layer *buckets*, the
collective units: bucket ``b`` of a stage (``PipelineSchedule.bucket_layers``) is bucket ``i`` of
one segment (:attr:`SyncSegments.units`), the same unit on every holder, so that every member of a
unit's group issues its collectives (:mod:`medley.schedule.zero`) and the simulator and the runtime
meet them as one.

The holders of a segment must agree on what its group does: the same TP degree (one slice per TP
rank) and the same ZeRO level and windows. A segment takes the most buckets any holder's setting
gives its share of layers (``ceil(buckets x segment layers / stage layers)``, at least one, at most
one per layer; one under the naive placement): for alike replicas that is the stage's own
``min(buckets, layers)``.

Global replica ``r`` is replica ``r - first`` of the group whose replicas start at ``first``
(groups in order).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

from medley.errors import MedleyInputError
from medley.plan.layout import PlanLayout
from medley.schedule.zero import split_evenly
from medley.schedule.zero_settings import Placement, StageZero

SHARED_FIELDS = ("model", "micro_batch_size", "seq_len", "placement", "dtype", "clip_grad",
                 "sequence_parallel", "adapter")
"""What every replica group of a plan has in common (the global batch's shape and precision)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Holder:
    """Where one replica holds a segment.

    Attributes:
        group: the replica group; replica: the global replica index; stage: the global stage of
            the group's schedule that holds the segment; pipeline_rank: the rank running it.
    """

    group: int
    replica: int
    stage: int
    pipeline_rank: int


@dataclass(frozen=True, kw_only=True)
class SyncSegment:
    """A layer range held whole by one stage of every replica.

    Attributes:
        first, stop: its layers, ``range(first, stop)`` (embedding and head count as layers).
        buckets: layers per bucket (the collective units), in layer order.
        holders: one per replica, in global replica order.
        tp: the TP degree every holder runs it at (one ZeRO group per TP rank).
        zero: the ZeRO setting its holders share (``buckets`` is the count above).
    """

    first: int
    stop: int
    buckets: tuple[int, ...]
    holders: tuple[Holder, ...]
    tp: int
    zero: StageZero

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)


@dataclass(frozen=True, kw_only=True)
class SyncSegments:
    """Every segment of a plan and how each stage's buckets map onto them.

    Attributes:
        segments: in layer order (for alike replicas: in stage order, one per stage).
        units: ``units[g][s]``: the (segment, bucket in segment) of each bucket of group g's stage
            s, in the stage's bucket order.
        first_replica: global index of each group's first replica.
        replicas: replicas of the whole plan.
    """

    segments: tuple[SyncSegment, ...]
    units: tuple[dict[int, tuple[tuple[int, int], ...]], ...]
    first_replica: tuple[int, ...]
    replicas: int

    def bucket_layers(self, group: int) -> dict[int, tuple[int, ...]]:
        """Layers per bucket of each stage of ``group``: its segments' buckets, in layer order."""
        return {stage: tuple(self.segments[seg].buckets[i] for seg, i in units)
                for stage, units in self.units[group].items()}

    def unit(self, group: int, stage: int, bucket: int | None) -> tuple[int, int]:
        """The (segment, bucket in segment) of an action's bucket (None: the stage's one bucket)."""
        units = self.units[group][stage]
        if bucket is None:
            if len(units) != 1:
                raise ValueError(f"group {group} stage {stage} has {len(units)} buckets; name one")
            return units[0]
        return units[bucket]

    def where(self, replica: int) -> tuple[int, int]:
        """(group, replica inside the group) of global replica ``replica``."""
        group = bisect_right(self.first_replica, replica) - 1
        return group, replica - self.first_replica[group]


def first_replicas(groups: Sequence[PlanLayout]) -> tuple[int, ...]:
    """Global index of each group's first replica."""
    starts, total = [], 0
    for layout in groups:
        starts.append(total)
        total += layout.dp
    return tuple(starts)


def check_groups(groups: Sequence[PlanLayout], *, where: str = "layout.replicas") -> None:
    """Refuse replica groups that cannot form one plan: a shared field that differs, a
    two-direction schedule among several groups, or a ``sync_dp`` that is not the plan's replicas."""
    if not groups:
        raise MedleyInputError(f"{where}: a plan needs at least one replica group")
    first = groups[0]
    for g, layout in enumerate(groups[1:], start=1):
        for name in SHARED_FIELDS:
            if getattr(layout, name) != getattr(first, name):
                raise MedleyInputError(
                    f"{where}[{g}]: {name} {getattr(layout, name)!r} differs from group 0's "
                    f"{getattr(first, name)!r}; every replica group trains the same model on the same "
                    "micro-batch shape in one precision")
    if len(groups) > 1:
        total = sum(layout.dp for layout in groups)
        for g, layout in enumerate(groups):
            if layout.schedule == "bidirectional":
                raise MedleyInputError(f"{where}[{g}]: schedule 'bidirectional' holds the model twice, "
                                       "which replicas of their own shape do not support; choose another")
            if layout.sync_dp != total:
                raise ValueError(f"replica group {g} has sync_dp {layout.sync_dp}; the plan has {total} "
                                 "replicas (use medley.plan.segments.joined)")


def joined(groups: Sequence[PlanLayout]) -> tuple[PlanLayout, ...]:
    """The groups of one plan, each told how many replicas its ZeRO groups span (one group: as
    given, ``sync_dp`` 0)."""
    if len(groups) == 1:
        return (replace(groups[0], sync_dp=0),)
    total = sum(layout.dp for layout in groups)
    return tuple(replace(layout, sync_dp=total) for layout in groups)


def _segment_buckets(holders: Sequence[tuple[PlanLayout, int]], first: int, stop: int) -> tuple[int, ...]:
    layers = stop - first
    count = 1
    for layout, stage in holders:
        if layout.placement is Placement.NAIVE:
            continue
        share = layout.zero[stage].buckets * layers / layout.stage_layers[stage]
        count = max(count, min(layers, math.ceil(share - 1e-9)))
    return tuple(split_evenly(layers, count))


def sync_segments(groups: Sequence[PlanLayout], stage_to_rank: Sequence[Sequence[int]], *,
                  where: str = "layout.replicas") -> SyncSegments:
    """The segments of the plan made of ``groups`` (``stage_to_rank[g]``: group g's schedule's).

    One group: one segment per stage (a two-direction schedule's stages too, which hold the model
    twice). Several: one per range between consecutive stage boundaries of any group; a
    :class:`~medley.errors.MedleyInputError` names the groups whose holders disagree on TP or ZeRO."""
    firsts = first_replicas(groups)
    if len(groups) == 1:
        ranges = map(groups[0].layer_range, range(groups[0].num_stages))
        spans = [(layers.start, layers.stop, [(0, stage)]) for stage, layers in enumerate(ranges)]
    else:
        cuts = sorted({layers.start for layout in groups for layers in _ranges(layout)}
                      | {groups[0].model.num_layers})
        spans = [(first, stop, [(g, _holding(layout, first)) for g, layout in enumerate(groups)])
                 for first, stop in itertools.pairwise(cuts)]
    segments = []
    units: list[dict[int, list[tuple[int, int]]]] = [{} for _ in groups]
    for first, stop, held in spans:
        stages = [(groups[g], stage) for g, stage in held]
        _check_agreement(stages, first, stop, where)
        holders = tuple(Holder(group=g, replica=firsts[g] + r, stage=stage,
                               pipeline_rank=stage_to_rank[g][stage])
                        for g, stage in held for r in range(groups[g].dp))
        buckets = _segment_buckets(stages, first, stop)
        lead, stage0 = stages[0]
        for g, stage in held:
            units[g].setdefault(stage, []).extend((len(segments), i) for i in range(len(buckets)))
        segments.append(SyncSegment(first=first, stop=stop, buckets=buckets, holders=holders,
                                    tp=lead.stage_tp(stage0), zero=lead.zero[stage0]))
    return SyncSegments(segments=tuple(segments),
                        units=tuple({s: tuple(u) for s, u in sorted(g.items())} for g in units),
                        first_replica=firsts, replicas=sum(layout.dp for layout in groups))


def _ranges(layout: PlanLayout) -> list[range]:
    return [layout.layer_range(s) for s in range(layout.num_stages)]


def _holding(layout: PlanLayout, layer: int) -> int:
    return next(s for s, layers in enumerate(_ranges(layout)) if layer in layers)


def _check_agreement(held: Sequence[tuple[PlanLayout, int]], first: int, stop: int, where: str) -> None:
    layout0, stage0 = held[0]
    for g, (layout, stage) in enumerate(held[1:], start=1):
        what = f"layers {first}..{stop - 1} (group 0 stage {stage0}, group {g} stage {stage})"
        if layout.stage_tp(stage) != layout0.stage_tp(stage0):
            raise MedleyInputError(
                f"{where}: {what} run at TP {layout0.stage_tp(stage0)} and {layout.stage_tp(stage)}; "
                "replicas that hold the same layers need the same TP degree there (change layout.tp)")
        mine, theirs = layout.zero[stage], layout0.zero[stage0]
        for name in ("level", "gather_windows", "grad_windows"):
            if getattr(mine, name) != getattr(theirs, name):
                raise MedleyInputError(
                    f"{where}: {what} have ZeRO {name} {getattr(theirs, name)} and {getattr(mine, name)}; "
                    "replicas that hold the same layers share one ZeRO group, so give their stages the "
                    "same layout.zero level and windows")
