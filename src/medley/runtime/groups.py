"""The process groups of a plan's ranks: who runs what, and which ranks talk to which.

``table[r][k]`` (a :data:`RankTable`) holds the global ranks of replica ``r``'s pipeline rank
``k`` in TP rank order: the ranks on the devices of ``layout.group(r, k)``
(:mod:`medley.runtime.placement` builds it from the ranks' devices; ``row_major_table`` without
one). Pipeline rank ``k`` has the same TP degree in every replica. From the table, every rank
creates, in one fixed order (``new_group`` is collective over the world):

* per replica, its *replica group* (every rank of the replica, pipeline rank by rank, TP rank by
  rank; with TP 1 everywhere, the replica's pipeline);
* per (replica, pipeline rank), its *TP group* (the ranks of ``table[r][k]``);
* per (pipeline rank k, TP rank j), its *dp group* (TP rank j of pipeline rank k in every
  replica, replica order): the group ZeRO shards and reduces over.

Each rank's pipeline rank then has a (dp, tp) :class:`DeviceMesh` over its dp and TP groups
(``DeviceMesh.from_group``): TP-sharded parameters live on its ``tp`` dimension and FSDP2 shards
them over its ``dp`` dimension (FSDP2 wants both from one mesh). torch's ``new_group`` sorts a
group's ranks by default (and ``init_device_mesh`` builds its groups that way), which would make a
group's order differ from the plan's for a placed table such as ``(((3,), (0,)), ((1,), (2,)))``;
every group here keeps the table's order (``sort_ranks=False``), so the group rank, the mesh
coordinate, the TP rank and the ZeRO shard index all equal the plan's position. Pipeline
transfers go over the world group, to the global ranks the table names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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
    """Refuse a table that does not hold each of the ``world`` ranks once, with the same number of
    pipeline ranks per replica and the same TP degree per pipeline rank in every replica."""
    degrees = [len(group) for group in table[0]] if table else []
    ranks = sorted(rank for row in table for group in row for rank in group)
    if (ranks != list(range(world)) or min(degrees, default=0) < 1
            or any([len(group) for group in row] != degrees for row in table)):
        raise ValueError(f"rank table {table} must hold each of the {world} ranks once, with "
                         f"{len(degrees)} pipeline ranks per replica of TP degrees {degrees} in each")


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
        mesh: the (dp, tp) mesh of this rank's pipeline rank: its dp group x its TP group.
        replica_group: every rank of this rank's replica, in plan order.
    """

    table: RankTable
    place: RankPlace
    mesh: DeviceMesh
    replica_group: dist.ProcessGroup

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


def make_groups(table: RankTable, device_type: str = "cpu") -> RankGroups:
    """Create every group of ``table`` (collective: every rank calls it with the same table) and
    return this rank's."""
    check_table(table, dist.get_world_size())
    dp, pp = len(table), len(table[0])
    place = place_in(table, dist.get_rank())
    replicas = [dist.new_group([rank for group in row for rank in group], sort_ranks=False) for row in table]
    tp_groups = [[dist.new_group(list(group), sort_ranks=False) for group in row] for row in table]
    dp_groups = [[dist.new_group([table[r][k][j] for r in range(dp)], sort_ranks=False)
                  for j in range(len(table[0][k]))] for k in range(pp)]
    r, k, j = place.replica, place.pipeline_rank, place.tp_rank
    ranks = torch.tensor([list(table[replica][k]) for replica in range(dp)])
    mesh = DeviceMesh.from_group([dp_groups[k][j], tp_groups[r][k]], device_type, mesh=ranks,
                                 mesh_dim_names=("dp", "tp"))
    return RankGroups(table=table, place=place, mesh=mesh, replica_group=replicas[r])
