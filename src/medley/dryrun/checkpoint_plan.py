"""Whether a checkpoint of one plan loads under another, from DCP metadata alone (nothing written).

A save (:meth:`medley.runtime.checkpoint.CheckpointStore.save`) has every rank hand DCP its tensors
(:func:`~medley.runtime.checkpoint.checkpoint_state`); DCP's default planner turns each rank's into
write items (a DTensor: its chunk, the offsets and sizes of the rank's shard; a whole tensor: one
chunk) and keeps one writer of each chunk that several ranks hold (replicated tensors, TP ranks'
copies of an FSDP-sharded norm) and the coordinator joins them into the checkpoint's ``Metadata``. Here the
write items of every rank of the plan come from the dry-run builds of its distinct ranks
(:mod:`medley.dryrun.ranks`): the ranks of a case hold the same tensors, each with its own
chunk, which torch computes from the rank's coordinate in the tensor's mesh (as DCP does for the
rank it runs on). From the joined metadata :func:`check_loadable` checks what a load checks before
it reads a byte (:func:`medley.runtime.checkpoint_verify.check_entries`: every key the other plan's
model and optimizer hold, with its dtype and global shape) and what it relies on: that each
tensor's saved chunks tile it (no element missing, none twice).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import (
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from medley.dryrun.ranks import RankReport
from medley.errors import MedleyInputError
from medley.plan.plan import Plan
from medley.runtime.checkpoint import checkpoint_state
from medley.runtime.checkpoint_verify import check_entries, entry_of, manifest_of
from medley.runtime.torch_adapter import shard_at
from medley.schedule.zero_settings import StageZero


def one_rank_plan(plan: Plan) -> Plan:
    """The plan's model and precision on one rank (one stage, ZeRO 0, no TP): a layout that needs
    every tensor of the model and optimizer whole."""
    shared = plan.shared
    layout = dataclasses.replace(
        shared, pp=1, dp=1, assignment=((plan.devices[0],),), stage_layers=(shared.model.num_layers,),
        schedule="1f1b", knobs={}, micro_batches=(1,), zero=(StageZero(level=0),), recompute=(), tp=(),
        sync_dp=0)
    return Plan(layout=layout, cluster=plan.cluster)


def rank_state(report: RankReport) -> dict[str, torch.Tensor]:
    """The tensors a save or load of the built rank hands DCP (tied copies included)."""
    with report.mode:
        state = checkpoint_state(report.stages, for_load=True)
        if any(stage.module.spec.tied_embeddings for stage in report.stages.values()):
            state.update(checkpoint_state(report.stages, for_load=True, copies=True))
    return state


def _coordinate(mesh: DeviceMesh, report: RankReport, rank: int) -> list[int]:
    """``rank``'s coordinate in the mesh that stands where ``mesh`` stands for the built rank: the
    same sub-mesh (``dp``, ``tp`` or both) of the (dp, tp) mesh of a segment both hold."""
    names = mesh.mesh_dim_names or ()
    mine = report.rank_groups.place.tp_rank
    for full in report.rank_groups.meshes.values():
        ranks = report.mesh_ranks[id(full)]
        built = (ranks == report.rank).nonzero()
        there = (ranks == rank).nonzero()
        if not built.numel() or not there.numel():
            continue
        (bi, bj), (i, j) = built[0].tolist(), there[0].tolist()
        sub = {("dp", "tp"): ranks, ("dp",): ranks[:, bj], ("tp",): ranks[bi, :]}.get(tuple(names))
        if sub is not None and torch.equal(sub, report.mesh_ranks[id(mesh)]):
            return [{"dp": i, "tp": j}[name] for name in names]
    raise ValueError(f"rank {rank} holds no mesh like {names} of rank {report.rank} (TP rank {mine})")


@functools.cache
def _chunk_of(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
              placements: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes and offsets of the shard at ``coordinate`` (torch's own computation, as DCP's)."""
    return shard_at(shape, mesh_shape, coordinate, placements)


def _shard_item(item: WriteItem, tensor: DTensor, coordinate: tuple[int, ...]) -> WriteItem:
    sizes, offsets = _chunk_of(tuple(tensor.shape), tuple(tensor.device_mesh.shape), coordinate,
                               tuple(tensor.placements))
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    assert item.tensor_data is not None
    return dataclasses.replace(item, index=dataclasses.replace(item.index, offset=torch.Size(offsets)),
                               tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk))


def save_metadata(reports: Sequence[RankReport]) -> Metadata:
    """The ``Metadata`` a save of the plan whose distinct ranks ``reports`` built would write: the
    write items of every rank of every case, whole tensors once."""
    plans: list[SavePlan] = []
    written: set[tuple[str, tuple[int, ...]]] = set()  # DCP's dedup_save_plans: one writer per chunk
    for report in reports:
        state = rank_state(report)
        items = create_default_local_save_plan(state, is_coordinator=True).items
        for rank in report.case.ranks:
            mine = []
            coordinates: dict[int, tuple[int, ...]] = {}
            for item in items:
                tensor = state[item.index.fqn]
                if item.type is WriteItemType.SHARD and isinstance(tensor, DTensor):
                    mesh = tensor.device_mesh
                    if id(mesh) not in coordinates:
                        coordinates[id(mesh)] = tuple(_coordinate(mesh, report, rank))
                    item = _shard_item(item, tensor, coordinates[id(mesh)])
                key = (item.index.fqn, tuple(item.index.offset or ()))
                if key not in written:
                    written.add(key)
                    mine.append(item)
            plans.append(SavePlan(mine))
    _, metadata = create_default_global_save_plan(plans, rewrite_index_hints=False)
    return metadata


def _uncovered(entry: TensorStorageMetadata) -> str | None:
    """Why the chunks of one saved tensor do not tile it, or None."""
    size = tuple(entry.size)
    if not entry.chunks:
        return "no chunk"
    shape = (len(entry.chunks), len(size))
    lo = np.array([tuple(c.offsets) for c in entry.chunks], dtype=np.int64).reshape(shape)
    extent = np.array([tuple(c.sizes) for c in entry.chunks], dtype=np.int64).reshape(shape)
    hi = lo + extent
    if (lo < 0).any() or (hi > np.array(size, dtype=np.int64)).any():
        return "a chunk lies outside the tensor"
    kept = extent.prod(axis=1) > 0
    lo, hi = lo[kept], hi[kept]
    if len(lo) > 1:
        overlap = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(axis=2)
        np.fill_diagonal(overlap, False)
        if overlap.any():
            return "two ranks save the same elements"
    volume = int((hi - lo).prod(axis=1).sum()) if len(lo) else 0
    total = int(np.prod(size)) if size else 1
    if volume != total:
        return f"the saved chunks hold {volume:,} of its {total:,} elements"
    return None


def check_loadable(metadata: Metadata, loaders: Sequence[RankReport], *, saved_by: str,
                   loaded_by: str) -> int:
    """Refuse (one :class:`MedleyInputError`) a checkpoint of ``saved_by`` (its ``metadata``) that
    the plan ``loaded_by`` (its distinct ranks ``loaders``) could not load: a key it needs missing
    or of another dtype or shape, a key it lacks, or a tensor whose chunks miss or repeat
    elements. Returns the number of entries checked."""
    for key, entry in sorted(metadata.state_dict_metadata.items()):
        if isinstance(entry, TensorStorageMetadata):
            problem = _uncovered(entry)
            if problem is not None:
                raise MedleyInputError(f"a checkpoint of {saved_by}: entry {key!r}: {problem}; the plan's "
                                       "sharding does not cover the tensor")
    expected = {key: entry_of(value) for key, value in
                itertools.chain.from_iterable(rank_state(report).items() for report in loaders)}
    check_entries(Path(saved_by), manifest_of(metadata), expected, optional=set(), what=loaded_by,
                  fix="the two plans hold different tensors (another model, optimizer or precision)")
    return len(expected)
