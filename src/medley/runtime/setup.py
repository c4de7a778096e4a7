"""Turn a plan into this rank's executable parts: mesh, stages, schedule and executor."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from medley.errors import MedleyInputError
from medley.plan.layout import PlanLayout, sequence_sharded_edges
from medley.plan.plan import Plan
from medley.plan.world import World, build_world
from medley.runtime import placement
from medley.runtime.executor import RankExecutor
from medley.runtime.groups import RankGroups, RankPlace, RankTable, make_groups, segment_holders
from medley.runtime.placement import PlacementEntry, ranks_needed
from medley.runtime.sharding import TORCH_DTYPES, ShardedStage
from medley.runtime.stages import build_local_stages
from medley.runtime.tensor_parallel import tp_synced_stages
from medley.runtime.tied import build_tied_grads
from medley.runtime.transformer import token_loss_sum
from medley.schedule.ir import PipelineSchedule, with_default_collectives
from medley.schedule.zero_checks import CollectiveMismatchError, check_zero_placement


@dataclass(kw_only=True)
class RankSetup:
    """This rank's share of the plan.

    Attributes:
        replica: global data-parallel replica index; pipeline_rank: rank inside the replica;
            tp_rank: rank inside the pipeline rank's TP group (all from the plan's assignment and
            tp and this rank's device, not from the launcher's rank order).
        group: the replica group of this rank's replica; layout: that group's layout (as run: its
            ``clip_grad`` is the run's).
        device: where this rank computes (cuda:LOCAL_RANK under nccl, else cpu).
        device_of_rank: the plan's device id of every global rank.
        groups: its process groups over the rank table (each in the plan's order): its pipeline
            rank's (dp, tp) mesh, its replica's group, the table.
        stages: this rank's stages by global stage index.
        executor: runs this rank's program of its replica's schedule.
        placement: where every rank runs, as each one measured it (by global rank).
    """

    replica: int
    pipeline_rank: int
    tp_rank: int
    group: int
    layout: PlanLayout
    device: torch.device
    device_of_rank: list[int]
    groups: RankGroups
    stages: dict[int, ShardedStage]
    executor: RankExecutor
    placement: list[PlacementEntry]


def check_plan(plan: Plan, world_size: int) -> None:
    """What the runtime cannot run, as errors naming the plan setting to change."""
    layout, model = plan.shared, plan.shared.model
    if world_size != plan.world_size:
        raise MedleyInputError(
            f"the plan needs {ranks_needed(plan)} but {world_size} "
            f"{'was' if world_size == 1 else 'were'} started; launch {plan.world_size} "
            f"(torchrun --nproc-per-node {plan.world_size}, or "
            f"--local-ranks {plan.world_size}) or change layout.pp / layout.dp / layout.tp")
    if any(group.schedule == "bidirectional" for group in plan.groups):
        raise MedleyInputError("layout.schedule 'bidirectional' (the model held twice) is not run by the "
                               "runtime; choose another schedule")
    if plan.asymmetric and model.tied_embeddings:
        raise MedleyInputError(f"model '{model.name}' ties its embeddings, which the runtime does not run "
                               "with replica groups of their own shape (layout.replicas) yet; plan alike "
                               "replicas (one group) for it")
    if model.word_embed_proj_dim is not None:
        raise MedleyInputError(f"model '{model.name}' projects its word embedding (word_embed_proj_dim), "
                               "which the runtime does not build; use another model")
    model.check_seq_len(layout.seq_len, field="layout.seq_len")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _placement(plan: Plan, device: torch.device) -> tuple[RankTable, list[int]]:
    """The rank table and every rank's plan device, from the identities the ranks exchange
    (collective, before any model is built); a rank off the plan fails every rank alike."""
    identities = placement.exchange_identities(plan.cluster, on_cuda=device.type == "cuda")
    return placement.rank_table(plan, identities), placement.device_table(plan, identities)


def _report(plan: Plan, place: RankPlace, *, device_id: int, stages: list[int]) -> list[PlacementEntry]:
    """Every rank's placement as it built it (collective), kept for the launcher to return."""
    entry = PlacementEntry(rank=dist.get_rank(), node=plan.cluster.devices[device_id].node, device=device_id,
                           replica=place.replica, pipeline_rank=place.pipeline_rank,
                           stages=tuple(stages), tp_rank=place.tp_rank)
    entries = placement.gather_entries(entry)
    placement.report(entries)
    return entries


@dataclass(kw_only=True)
class RankParts:
    """What every build of a rank makes, whether it then runs (:func:`build_rank`) or is counted
    (:func:`medley.dryrun.ranks.build_rank`).

    Attributes:
        groups: its process groups over the rank table; group: its replica group;
        layout: that group's layout; schedule: its replica's schedule (default collectives placed);
        stages: its stages by global stage index.
    """

    groups: RankGroups
    group: int
    layout: PlanLayout
    schedule: PipelineSchedule
    stages: dict[int, ShardedStage]


def build_parts(world: World, table: RankTable, *, device: torch.device, seed: int,
                optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                dtype: str | None = None, init_from: Path | None = None, compile: bool = False,
                materialize: bool = True) -> RankParts:
    """This rank's groups, schedule and stages of ``world`` (collective: every rank of ``table``
    calls it), the one build a run and a dry run share: the ZeRO placement checked, TP with the
    layout's sequence parallelism, ZeRO sharding on its segments' meshes. ``dtype``: the run's
    precision (None: the layout's); ``materialize`` False leaves the stages on the meta device
    (:func:`medley.runtime.stages.build_local_stages`). Under CUDA the default device becomes
    ``device`` once the groups exist."""
    groups = make_groups(table, segment_holders(world.segments), device.type)
    group, _ = world.segments.where(groups.place.replica)
    layout = world.groups[group]
    schedule = with_default_collectives(world.schedules[groups.place.replica])
    try:
        check_zero_placement(schedule, layout.zero)
    except CollectiveMismatchError as err:
        raise MedleyInputError(f"layout.zero / layout.placement give an unrunnable schedule: {err}") from None
    if device.type == "cuda":
        torch.set_default_device(device)
    stages = build_local_stages(layout.model, schedule=schedule, split=layout.stage_layers,
                                zero=[z.level for z in layout.zero], groups=groups, seed=seed,
                                optimizer_class=optimizer_class, optimizer_kwargs=optimizer_kwargs,
                                recompute=layout.recompute, init_from=init_from,
                                precision=layout.dtype if dtype is None else dtype,
                                units=world.segments.units[group], materialize=materialize,
                                sequence_parallel=layout.sequence_parallel,
                                sequence_edges=sequence_sharded_edges(layout), compile=compile,
                                adapter=layout.adapter)
    return RankParts(groups=groups, group=group, layout=layout, schedule=schedule, stages=stages)


def build_rank(plan: Plan, *, seed: int, optimizer_class: type[torch.optim.Optimizer],
               optimizer_kwargs: dict[str, Any], dtype: str = "fp32",
               clip_grad: bool = False, slowdown: Mapping[int, float] | None = None,
               init_from: Path | None = None, compile: bool = False) -> RankSetup:
    """Build this rank's stages and executor for ``plan`` (collective: every rank calls it).

    ``clip_grad`` decides whether the schedules carry the ``CLIP`` action (the run's clipping
    setting wins over ``layout.clip_grad``, which only says what the plan's prediction assumed);
    the caller sets ``executor.on_clip``. A plan with ``layout.tied_copies`` always carries
    ``CLIP``: its tied gradients are summed there (:mod:`medley.runtime.tied`), before any
    optimizer step. ``init_from``: a Hugging Face model directory the stages
    read their weights from (else the seeded initialisation). ``dtype`` (fp32, bf16, fp16): the
    run's precision: half precision computes under autocast, gathers weights and reduces gradients
    in the dtypes the simulator counts (:func:`medley.cost.zero_memory.state_bytes_per_param`) and
    passes activations between stages in the compute dtype. ``compile``: torch.compile each block
    (:mod:`medley.runtime.torch_compile`).
    """
    device = _device()
    table, devices = _placement(plan, device)
    check_plan(plan, dist.get_world_size())
    world = build_world([dataclasses.replace(layout, clip_grad=clip_grad) for layout in plan.groups])
    parts = build_parts(world, table, device=device, seed=seed, optimizer_class=optimizer_class,
                        optimizer_kwargs=optimizer_kwargs, dtype=dtype, init_from=init_from, compile=compile)
    groups, layout, stages = parts.groups, parts.layout, parts.stages
    place = groups.place
    levels = [z.level for z in layout.zero]
    me = devices[dist.get_rank()]
    factor = 1.0 if slowdown is None else slowdown[me]
    executor = RankExecutor(
        schedule=parts.schedule, pipeline_rank=place.pipeline_rank, stages=stages, pipeline=groups.pipeline,
        tp_rank=place.tp_rank,
        activation_shape=(layout.micro_batch_size, layout.seq_len, layout.model.hidden_size),
        loss_fn=token_loss_sum,
        autocast_dtype=None if dtype == "fp32" else TORCH_DTYPES[dtype], dtype=TORCH_DTYPES[dtype],
        slowdown=factor, device=device, synced_stages=tp_synced_stages(layout),
        tp_group=groups.tp_group, sequence_edges=sequence_sharded_edges(layout))
    if layout.tied_copies and layout.adapter is None:  # a LoRA run's tied copies are frozen: equal
        tied_grads = build_tied_grads(groups, list(world.schedules), stages, levels)
        executor.before_clip = None if tied_grads is None else tied_grads.sum_grads
    entries = _report(plan, place, device_id=me, stages=sorted(stages))
    return RankSetup(replica=place.replica, pipeline_rank=place.pipeline_rank, tp_rank=place.tp_rank,
                     group=parts.group, layout=layout, device=device, device_of_rank=devices, groups=groups,
                     stages=stages, executor=executor, placement=entries)
