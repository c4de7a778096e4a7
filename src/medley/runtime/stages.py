"""A rank's share of a plan: its pipeline stages, built alone, on a (dp x pp) device mesh.

Which global rank runs pipeline rank ``p`` of replica ``r`` is a rank table (from the plan's
assignment and the ranks' devices, :mod:`medley.runtime.placement`; ``row_major_table`` without
one): the mesh, the P2P peers and the ZeRO groups all follow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from medley.runtime.hf_weights import load_hf_tensors
from medley.runtime.model import Decoder
from medley.runtime.sharding import ShardedStage, shard_stage
from medley.schedule.ir import PipelineSchedule
from medley.spec.model import ModelSpec


def layer_ranges(split: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """``[first, last)`` layer range of each global stage from the layers per stage (embedding and
    head count as layers)."""
    if min(split, default=0) < 1:
        raise ValueError(f"every stage needs at least one layer, got split {tuple(split)}")
    if sum(split) != num_layers:
        raise ValueError(f"split {tuple(split)} covers {sum(split)} layers but the model has {num_layers} "
                         "(embedding + blocks + head)")
    ranges, start = [], 0
    for size in split:
        ranges.append((start, start + size))
        start += size
    return ranges


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlace:
    """Where this rank sits: replica index and pipeline rank inside the replica."""

    replica: int
    pipeline_rank: int


RankTable = tuple[tuple[int, ...], ...]


def row_major_table(pp: int, dp: int) -> RankTable:
    """Global rank ``r * pp + p`` on pipeline rank ``p`` of replica ``r``."""
    return tuple(tuple(r * pp + p for p in range(pp)) for r in range(dp))


def make_mesh(table: RankTable, device_type: str = "cpu") -> DeviceMesh:
    """The (dp, pp) mesh of ``table`` over the initialised default process group (collective).

    torch's ``new_group`` sorts a group's ranks by default (and ``init_device_mesh`` builds its
    groups that way), which would make a replica's group order differ from its pipeline order
    for a placed table such as ``((3, 0), (1, 2))``. Every group here keeps the table's order
    (``sort_ranks=False``), so in each group the group rank, the mesh coordinate, the P2P peer
    and the ZeRO shard index all equal the plan's position."""
    dp, pp = len(table), len(table[0])
    world = dist.get_world_size()
    if sorted(r for row in table for r in row) != list(range(world)) or any(len(row) != pp for row in table):
        raise ValueError(f"rank table {table} must hold each of the {world} ranks once, {pp} per replica")
    place = _place_in(table, dist.get_rank())
    rows = [dist.new_group(list(row), sort_ranks=False) for row in table]
    columns = [dist.new_group([table[r][p] for r in range(dp)], sort_ranks=False) for p in range(pp)]
    return DeviceMesh.from_group([columns[place.pipeline_rank], rows[place.replica]], device_type,
                                 mesh=torch.tensor(table), mesh_dim_names=("dp", "pp"))


def _place_in(table: RankTable, rank: int) -> RankPlace:
    return next(RankPlace(replica=r, pipeline_rank=p)
                for r, row in enumerate(table) for p, member in enumerate(row) if member == rank)


def rank_place(mesh: DeviceMesh) -> RankPlace:
    """This rank's place: its coordinate in the mesh (which :func:`make_mesh`'s groups share)."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the mesh"
    return RankPlace(replica=coordinate[0], pipeline_rank=coordinate[1])


def build_local_stages(
    spec: ModelSpec, *, schedule: PipelineSchedule, split: Sequence[int], zero: Sequence[int],
    mesh: DeviceMesh, seed: int, optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any], recompute: Sequence[bool] = (), init_from: Path | None = None,
    precision: str = "fp32",
) -> dict[int, ShardedStage]:
    """Build and shard only the stages this rank runs in ``schedule`` (its replica's program); with
    ``init_from`` (a Hugging Face model directory) each stage reads its own layers' weights from it
    (under ZeRO-1/2/3 only this rank's rows of them); ``precision``: the run's dtype (see
    :func:`medley.runtime.sharding.shard_stage`)."""
    if len(split) != schedule.num_stages or len(zero) != schedule.num_stages:
        raise ValueError(f"split {tuple(split)} and zero {tuple(zero)} must give one entry per stage "
                         f"({schedule.num_stages} stages)")
    ranges = layer_ranges(split, spec.num_layers)
    place = rank_place(mesh)
    dp_mesh = mesh["dp"]
    stages: dict[int, ShardedStage] = {}
    for stage in schedule.stages_of_rank(place.pipeline_rank):
        first, last = ranges[stage]
        module = Decoder(spec, first_layer=first, last_layer=last, seed=seed,
                         recompute=bool(recompute and recompute[stage]), init=init_from is None)
        stages[stage] = shard_stage(module, zero=zero[stage], bucket_layers=schedule.bucket_layers.get(stage),
                                    dp_mesh=dp_mesh, optimizer_class=optimizer_class,
                                    optimizer_kwargs=optimizer_kwargs, precision=precision)
        if init_from is not None:  # after sharding, as a checkpoint load: a ZeRO-2/3 rank reads its rows
            load_hf_tensors(spec, stages[stage].named_parameters_local(), init_from)
            stages[stage].refresh_gathered()
    return stages
