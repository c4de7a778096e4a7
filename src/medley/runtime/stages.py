"""A rank's share of a plan: its pipeline stages, built alone, on a (dp x pp) device mesh.

Ranks are laid out replica-major: global rank ``r * pp + p`` runs pipeline rank ``p`` of replica
``r``, so one replica's ranks are neighbours (one node per replica on a real cluster).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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


def make_mesh(pp: int, dp: int, device_type: str = "cpu") -> DeviceMesh:
    """The (dp, pp) mesh over the initialised default process group."""
    if dist.get_world_size() != pp * dp:
        raise ValueError(f"world size {dist.get_world_size()} != pp {pp} x dp {dp}")
    return init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))


def rank_place(mesh: DeviceMesh) -> RankPlace:
    return RankPlace(replica=mesh["dp"].get_local_rank(), pipeline_rank=mesh["pp"].get_local_rank())


def build_local_stages(
    spec: ModelSpec, *, schedule: PipelineSchedule, split: Sequence[int], zero: Sequence[int],
    mesh: DeviceMesh, seed: int, optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any], recompute: Sequence[bool] = (),
) -> dict[int, ShardedStage]:
    """Build and shard only the stages this rank runs in ``schedule`` (its replica's program)."""
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
                         recompute=bool(recompute and recompute[stage]))
        stages[stage] = shard_stage(module, zero=zero[stage], bucket_layers=schedule.bucket_layers.get(stage),
                                    dp_mesh=dp_mesh, optimizer_class=optimizer_class,
                                    optimizer_kwargs=optimizer_kwargs)
    return stages
