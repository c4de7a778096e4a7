"""Every replica's schedule of a plan, with the ZeRO collectives of its sync segments placed.

The runtime, the compiler and the plan loader all build schedules here: one per replica, replica
groups in order (:mod:`medley.plan.segments`). Each group's programs come from its schedule family;
the collectives of every stage are placed by :func:`medley.schedule.zero.place_collectives` over
the buckets of its segments, so that a unit that several groups share gets the same collectives on
every holder. Replica groups of their own shape are then checked to run together
(:func:`medley.schedule.world_order.check_world_order`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from medley.cost.zero_levels import zero_level
from medley.errors import MedleyInputError
from medley.plan.layout import PlanLayout
from medley.plan.segments import SyncSegments, check_groups, sync_segments
from medley.schedule.generators import generate
from medley.schedule.ir import COMPUTE_KINDS, Action, Kind, PipelineSchedule
from medley.schedule.world_order import Rank, WorldOrderError, check_world_order
from medley.schedule.zero import place_collectives
from medley.schedule.zero_checks import CollectiveMismatchError


@dataclass(frozen=True, kw_only=True)
class World:
    """A plan's schedules and segments.

    Attributes:
        groups: the replica groups.
        schedules: one per global replica (groups in order), collectives placed.
        segments: the plan's sync segments.
    """

    groups: tuple[PlanLayout, ...]
    schedules: tuple[PipelineSchedule, ...]
    segments: SyncSegments

    def schedules_of(self, group: int) -> list[PipelineSchedule]:
        first = self.segments.first_replica[group]
        return list(self.schedules[first:first + self.groups[group].dp])

    @property
    def clip(self) -> bool:
        """Whether every program carries the world-wide ``CLIP`` (clipping, or tied copies)."""
        return any(layout.clip_grad or layout.tied_copies for layout in self.groups)


def _generated(layout: PlanLayout, where: str) -> list[PipelineSchedule]:
    generated: dict[int, PipelineSchedule] = {}
    for micro_batches in dict.fromkeys(layout.micro_batches):
        try:
            generated[micro_batches] = generate(layout.schedule, pp=layout.pp, micro_batches=micro_batches,
                                                **layout.knobs)
        except ValueError as err:
            raise MedleyInputError(f"{where}--schedule {layout.schedule}: {err}") from None
    schedules = [generated[m] for m in layout.micro_batches]
    if schedules[0].num_stages != layout.num_stages:
        raise MedleyInputError(
            f"{where}--split gives {layout.num_stages} stages but schedule '{layout.schedule}' with "
            f"pp={layout.pp} has {schedules[0].num_stages}; give one layer count per stage")
    return schedules


def build_world(groups: Sequence[PlanLayout]) -> World:
    """The schedules of the plan made of ``groups`` (one: a plan of alike replicas)."""
    groups = tuple(groups)
    check_groups(groups)
    several = len(groups) > 1
    where = [f"layout.replicas[{g}]: " if several else "" for g in range(len(groups))]
    generated = [_generated(layout, where[g]) for g, layout in enumerate(groups)]
    segments = sync_segments(groups, [schedules[0].stage_to_rank for schedules in generated])
    clip = any(layout.clip_grad or layout.tied_copies for layout in groups)
    rounds, alike = _shared_rounds(groups, generated, segments) if several else (None, None)
    placed: list[PipelineSchedule] = []
    for g, layout in enumerate(groups):
        try:
            placed += place_collectives(
                generated[g], layout.zero, stage_layers=layout.stage_layers, policy=layout.placement,
                clip_grad=clip, buckets=segments.bucket_layers(g),
                rounds=None if rounds is None else rounds[g], alike=None if alike is None else alike[g])
        except CollectiveMismatchError as err:
            raise MedleyInputError(f"{where[g]}--zero / --zero-placement / --gather-windows (the plan's "
                                   f"layout.zero): {err}") from None
    world = World(groups=groups, schedules=tuple(placed), segments=segments)
    if several:
        try:
            check_world_order(world.schedules, lambda replica, action: collective_key(world, replica, action),
                              kin=lambda replica: world.segments.where(replica)[0])
        except WorldOrderError as err:
            raise MedleyInputError(f"layout.replicas: {err}; give the groups other splits or schedules, "
                                   "or ZeRO level 0 where they meet") from None
    return world


def build_schedules(layout: PlanLayout) -> list[PipelineSchedule]:
    """One schedule per replica of a plan of alike replicas, with the ZeRO collectives placed."""
    return list(build_world((layout,)).schedules)


def step_actions(schedules: Sequence[PipelineSchedule]) -> int:
    """The actions of one step, summed over the replicas' schedules (what the simulator runs);
    a program several replicas share is counted once per replica but walked once."""
    sizes: dict[int, int] = {}
    total = 0
    for schedule in schedules:
        size = sizes.get(id(schedule))
        if size is None:
            size = sizes[id(schedule)] = sum(map(len, schedule.actions))
        total += size
    return total


def collective_key(world: World, replica: int, action: Action) -> tuple[tuple[Rank, ...], Hashable] | None:
    """Who a collective action of global replica ``replica`` waits for, and which it is
    (:data:`medley.schedule.world_order.CollectiveKey`): a unit's holders for its gathers and
    reductions, every rank for ``CLIP``; None for local actions."""
    segments = world.segments
    if action.kind is Kind.CLIP:
        ranks = tuple((r, k) for r, schedule in enumerate(world.schedules) for k in range(schedule.num_ranks))
        return ranks, "CLIP"
    group, _ = segments.where(replica)
    layout = world.groups[group]
    op, _ = zero_level(layout.zero[action.stage].level).collective(action.kind.value)
    if op is None or layout.zero_dp == 1:  # one replica: every ZeRO level runs as level 0, alone
        return None
    unit = segments.unit(group, action.stage, action.bucket)
    members = tuple((h.replica, h.pipeline_rank) for h in segments.segments[unit[0]].holders)
    return members, (action.kind, unit)


def _shared_rounds(groups: Sequence[PlanLayout], generated: Sequence[Sequence[PipelineSchedule]],
                   segments: SyncSegments) -> tuple[list[list[int]], list[list[bool]]]:
    """Per group and stage: the compute actions a per-action ZeRO-3 gather pads to, and whether
    every member runs the same kinds of compute in the same order, over every stage that shares a
    unit with it (transitively: those stages' groups must issue alike)."""
    nodes = [(g, s) for g, layout in enumerate(groups) for s in range(layout.num_stages)]
    parent = {node: node for node in nodes}

    def find(node: tuple[int, int]) -> tuple[int, int]:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for segment in segments.segments:
        first = (segment.holders[0].group, segment.holders[0].stage)
        for holder in segment.holders[1:]:
            parent[find((holder.group, holder.stage))] = find(first)
    kinds: dict[tuple[int, int], set[tuple[Kind, ...]]] = {}
    for g, schedules in enumerate(generated):
        for schedule in schedules:
            for s in range(schedule.num_stages):
                row = schedule.actions[schedule.stage_to_rank[s]]
                kinds.setdefault((g, s), set()).add(tuple(a.kind for a in row if a.stage == s
                                                           and a.kind in COMPUTE_KINDS))
    most: dict[tuple[int, int], int] = {}
    variants: dict[tuple[int, int], set[tuple[Kind, ...]]] = {}
    for node in nodes:
        root = find(node)
        most[root] = max(most.get(root, 0), max(len(k) for k in kinds[node]))
        variants.setdefault(root, set()).update(kinds[node])
    rounds = [[most[find((g, s))] for s in range(layout.num_stages)] for g, layout in enumerate(groups)]
    alike = [[len(variants[find((g, s))]) == 1 for s in range(layout.num_stages)]
             for g, layout in enumerate(groups)]
    return rounds, alike


def device_roles(world: World) -> dict[int, str]:
    """Each device's part of the plan, for pictures: its replica group's shape (pp, schedule) and
    the layers of its stages (``g1 pp2 1f1b · layers 3-5``)."""
    roles: dict[int, str] = {}
    for replica, schedule in enumerate(world.schedules):
        group, local = world.segments.where(replica)
        layout = world.groups[group]
        shape = f"g{group} pp{layout.pp} {layout.schedule}"
        for rank in range(layout.pp):
            spans = [layout.layer_range(s) for s in schedule.stages_of_rank(rank)]
            layers = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in spans)
            for device in layout.group(local, rank):
                roles[device] = f"{shape} · layers {layers}"
    return roles
