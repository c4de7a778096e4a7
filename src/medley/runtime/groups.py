"""The process groups of a plan's ranks: who runs what, and which ranks talk to which.

``table[r][k]`` (a :data:`RankTable`) holds the global ranks of global replica ``r``'s pipeline
rank ``k`` in TP rank order: the ranks on the devices of that replica group's ``layout.group``
(:mod:`medley.runtime.placement` builds it from the ranks' devices; ``row_major_table`` without
one). Replicas of one group have one shape; replicas of different groups may differ in depth and
TP degrees. From the table and the plan's sync segments (:mod:`medley.plan.segments`), every rank
creates, in one fixed order (``new_group`` is collective over the world):

* per replica, its *replica group* (every rank of the replica, pipeline rank by rank, TP rank by
  rank; with TP 1 everywhere, the replica's pipeline);
* per (replica, pipeline rank), its *TP group* (the ranks of ``table[r][k]``);
* per segment and TP rank j, its *ZeRO group* (TP rank j of the segment's holder in every
  replica, replica order): the group ZeRO shards and reduces over. Segments held by the same ranks
  share one group: for alike replicas, one per (pipeline rank, TP rank), as the stages of an
  interleaved rank share theirs.

Each segment a rank holds has a (dp, tp) :class:`DeviceMesh` over its ZeRO and TP groups
(``DeviceMesh.from_group``): TP-sharded parameters live on its ``tp`` dimension and FSDP2 shards
them over its ``dp`` dimension (FSDP2 wants both from one mesh). torch's ``new_group`` sorts a
group's ranks by default (and ``init_device_mesh`` builds its groups that way), which would make a
group's order differ from the plan's for a placed table such as ``(((3,), (0,)), ((1,), (2,)))``;
every group here keeps the table's order (:func:`~medley.runtime.torch_adapter.ordered_group`,
unsorted), so the group rank, the mesh coordinate, the TP rank and the ZeRO
shard index all equal the plan's position. Pipeline transfers go over the world group, to the
global ranks the table names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from medley.plan.segments import SyncSegments
from medley.runtime.torch_adapter import ordered_group

RankTable = tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlace:
    """Where this rank sits: replica index, pipeline rank inside the replica, TP rank inside the
    pipeline rank's TP group."""

    replica: int
    pipeline_rank: int
    tp_rank: int = 0


def row_major_table(pp: int, dp: int, tp: Sequence[int] = ()) -> RankTable:
    """Consecutive global ranks replica by replica, pipeline rank by rank, TP rank by rank (as
    ``PlanLayout.devices`` orders a plan's devices); ``tp``: degree per pipeline rank (empty: 1)."""
    degrees = tuple(tp) or (1,) * pp
    per_replica = sum(degrees)
    starts = [sum(degrees[:k]) for k in range(pp)]
    return tuple(tuple(tuple(range(r * per_replica + starts[k], r * per_replica + starts[k] + degrees[k]))
                       for k in range(pp)) for r in range(dp))


def check_table(table: RankTable, world: int) -> None:
    """Refuse a table that does not hold each of the ``world`` ranks once, or a pipeline rank
    without a rank."""
    ranks = sorted(rank for row in table for group in row for rank in group)
    if ranks != list(range(world)) or any(not row or min(map(len, row)) < 1 for row in table):
        raise ValueError(f"rank table {table} must hold each of the {world} ranks once, with at least one "
                         "rank per pipeline rank")


def place_in(table: RankTable, rank: int) -> RankPlace:
    """Where ``rank`` sits in ``table``."""
    return next(RankPlace(replica=r, pipeline_rank=k, tp_rank=j)
                for r, row in enumerate(table) for k, group in enumerate(row)
                for j, member in enumerate(group) if member == rank)


@dataclass(frozen=True, kw_only=True)
class RankGroups:
    """This rank's groups (see the module doc).

    Attributes:
        table: the rank table of the whole world.
        place: this rank's place in it.
        meshes: the (dp, tp) mesh of each segment this rank holds, by segment index.
        replica_group: every rank of this rank's replica, in plan order.
    """

    table: RankTable
    place: RankPlace
    meshes: dict[int, DeviceMesh]
    replica_group: dist.ProcessGroup

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh of this rank's first segment (its TP dimension is the rank's TP group)."""
        return self.meshes[min(self.meshes)]

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """This rank's TP group (None at degree 1)."""
        return self.tp_mesh.get_group() if self.tp > 1 else None

    @property
    def tp(self) -> int:
        """This rank's TP degree."""
        return len(self.pipeline[self.place.pipeline_rank])

    @property
    def pipeline(self) -> tuple[tuple[int, ...], ...]:
        """Global ranks of each pipeline rank of this rank's replica (TP rank order)."""
        return self.table[self.place.replica]


def segment_holders(segments: SyncSegments) -> list[tuple[tuple[int, int], ...]]:
    """The holders ((global replica, pipeline rank), replica order) of each of a plan's segments."""
    return [tuple((h.replica, h.pipeline_rank) for h in segment.holders) for segment in segments.segments]


def make_groups(table: RankTable, holders: Sequence[tuple[tuple[int, int], ...]] | None = None,
                device_type: str = "cpu") -> RankGroups:
    """Create every group of ``table`` (collective: every rank calls it with the same table and
    holders) and return this rank's. ``holders[s]``: the (replica, pipeline rank) holding segment
    ``s`` in each replica (:func:`segment_holders`); None: one segment per pipeline rank, held by
    that rank of every replica (alike replicas)."""
    check_table(table, dist.get_world_size())
    if holders is None:
        holders = [tuple((r, k) for r in range(len(table))) for k in range(len(table[0]))]
    place = place_in(table, dist.get_rank())
    replicas = [ordered_group([rank for group in row for rank in group]) for row in table]
    tp_groups = [[ordered_group(group) for group in row] for row in table]
    columns: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for members in holders:
        degrees = {len(table[r][k]) for r, k in members}
        if len(degrees) != 1:
            raise ValueError(f"a segment's holders {members} have TP degrees {sorted(degrees)}; they must "
                             "be one degree")
        for j in range(degrees.pop()):
            columns.setdefault(tuple(table[r][k][j] for r, k in members), None)
    for column in columns:
        columns[column] = ordered_group(column)
    r, k, j = place.replica, place.pipeline_rank, place.tp_rank
    meshes: dict[int, DeviceMesh] = {}
    made: dict[tuple[int, ...], DeviceMesh] = {}
    for segment, members in enumerate(holders):
        if (r, k) not in members:
            continue
        column = tuple(table[rr][kk][j] for rr, kk in members)
        if column not in made:
            ranks = torch.tensor([list(table[rr][kk]) for rr, kk in members])
            made[column] = DeviceMesh.from_group([columns[column], tp_groups[r][k]], device_type, mesh=ranks,
                                                 mesh_dim_names=("dp", "tp"))
        meshes[segment] = made[column]
    return RankGroups(table=table, place=place, meshes=meshes, replica_group=replicas[r])
