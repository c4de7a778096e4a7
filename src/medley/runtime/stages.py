"""A rank's share of a plan: its pipeline stages, built alone, tensor-parallel over its TP group
and ZeRO-sharded over its dp group (:mod:`medley.runtime.groups` makes both from the rank table).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from medley.cost.zero_memory import state_bytes_per_param
from medley.errors import MedleyInputError
from medley.runtime.groups import RankGroups
from medley.runtime.hf_weights import load_hf_tensors
from medley.runtime.lora import freeze_base
from medley.runtime.materialize import init_local_shards
from medley.runtime.sharding import TORCH_DTYPES, ShardedStage, bucket_layer_groups, shard_stage
from medley.runtime.tensor_parallel import apply_sequence_edges, parallelize_blocks
from medley.runtime.torch_compile import apply_compile, splits_backward
from medley.runtime.transformer import Decoder
from medley.schedule.ir import PipelineSchedule
from medley.spec.adapter import LoraSpec
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


def build_local_stages(
    spec: ModelSpec, *, schedule: PipelineSchedule, split: Sequence[int], zero: Sequence[int],
    groups: RankGroups, seed: int, optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any], recompute: Sequence[bool] = (), init_from: Path | None = None,
    precision: str = "fp32", units: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    materialize: bool = True, sequence_parallel: bool = False, sequence_edges: frozenset[int] = frozenset(),
    compile: bool = False, adapter: LoraSpec | None = None,
) -> dict[int, ShardedStage]:
    """Build, tensor-parallelise (TP degree > 1) and shard only the stages this rank runs in
    ``schedule`` (its replica's program), as torchtitan does: each stage is built on the meta
    device, TP and the ZeRO level's FSDP2 units are applied there, and only then does it get
    storage (on the default device) for this rank's shards, which take their part of the seeded
    initialisation (:mod:`medley.runtime.materialize`; bit-identical to the whole model's) or,
    with ``init_from`` (a Hugging Face model directory), just their rows of its weights. No rank
    ever holds a whole stage: at most one whole parameter beside its shards.

    ``materialize`` False leaves the stages on the meta device once TP and FSDP2 are applied
    (shapes, placements and process groups only: a dry run's; nothing is read or initialised).
    ``precision``: the run's dtype (see :func:`medley.runtime.sharding.shard_stage`). ``units[s]``:
    the (segment, bucket in segment) of each bucket of stage s
    (:attr:`medley.plan.segments.SyncSegments.units`): each bucket is sharded over, and its blocks
    split on, its segment's mesh (``groups.meshes``); None: every bucket on the rank's one mesh
    (alike replicas). ``sequence_parallel``: TP stages run sequence parallelism, their shards
    crossing the edges ``sequence_edges`` names (:func:`medley.plan.layout.sequence_sharded_edges`).
    ``compile``: each block is compiled (:func:`medley.runtime.torch_compile.apply_compile`) after TP and
    before ZeRO sharding. ``adapter``: LoRA adapters on the blocks, the base frozen once TP has
    placed it and held in the compute dtype (:mod:`medley.runtime.lora`); with ``init_from`` the
    base is read and the adapters take their seeded initialisation."""
    if len(split) != schedule.num_stages or len(zero) != schedule.num_stages:
        raise ValueError(f"split {tuple(split)} and zero {tuple(zero)} must give one entry per stage "
                         f"({schedule.num_stages} stages)")
    ranges = layer_ranges(split, spec.num_layers)
    place = groups.place
    stages: dict[int, ShardedStage] = {}
    error: MedleyInputError | None = None
    for stage in schedule.stages_of_rank(place.pipeline_rank):
        first, last = ranges[stage]
        with torch.device("meta"):
            module = Decoder(spec, first_layer=first, last_layer=last, seed=seed,
                             recompute=recompute[stage] if recompute else False, init=False, adapter=adapter)
        buckets = bucket_layer_groups(list(range(first, last)), schedule.bucket_layers.get(stage))
        meshes = ([groups.mesh] * len(buckets) if units is None
                  else [groups.meshes[segment] for segment, _ in units[stage]])
        for layers, mesh in zip(buckets, meshes, strict=True):
            parallelize_blocks(module, mesh["tp"], layers=layers, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            apply_sequence_edges(module, meshes[0]["tp"], sharded_input=stage - 1 in sequence_edges,
                                 sharded_output=stage in sequence_edges)
        if adapter is not None:
            freeze_base(module, dtype=TORCH_DTYPES[state_bytes_per_param(precision).weight_dtype])
        if compile:
            apply_compile(module, split_backward=splits_backward(schedule, place.pipeline_rank))
        stages[stage] = shard_stage(module, zero=zero[stage], bucket_layers=schedule.bucket_layers.get(stage),
                                    dp_mesh=[mesh["dp"] for mesh in meshes], optimizer_class=optimizer_class,
                                    optimizer_kwargs=optimizer_kwargs, precision=precision,
                                    tp_rank=place.tp_rank,
                                    device=torch.get_default_device() if materialize else None)
        if not materialize:
            continue
        if init_from is None:
            init_local_shards(module, seed)
        elif error is None:  # each rank reads its own shards' rows (a TP slice, FSDP2's dim-0 piece)
            local = stages[stage].named_parameters_local()
            error = _reading(functools.partial(load_hf_tensors, spec, local, init_from))
            init_local_shards(module, seed, adapters_only=True)
        if stages[stage].meaning.gathers_after_step:
            stages[stage].unshard(None)  # levels 1-2 keep the weights gathered between steps
    if init_from is not None and materialize:
        _agree(error)
    return stages


def _reading(load: Callable[[], None]) -> MedleyInputError | None:
    try:
        load()
    except MedleyInputError as err:
        return err
    return None


def _agree(error: MedleyInputError | None) -> None:
    """Each rank reads only its own layers' weights, so a bad tensor (NaN, an integer dtype) is
    seen by the ranks that read it alone: every rank learns of it here and stops with its one
    line. (A rank that stopped alone left the others failing in their next collective, and the
    launcher reported their "connection closed" instead.)"""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else str(error))
    first = next((message for message in found if message), None)
    if first is not None:
        raise MedleyInputError(first)
