"""A plan's ranks built one at a time on one CPU, at any scale, against the memory model.

torch's fake process group (``init_process_group("fake")``, as torchtitan's ``COMM_MODE=
fake_backend`` does) lets this one process be any rank of a world of any size: every group of the
plan is created as :func:`medley.runtime.groups.make_groups` creates it for a real run, and
collectives return at once. The rank's stages are built on the meta device (no memory), tensor-
parallelised and ZeRO-sharded as :func:`medley.runtime.stages.build_local_stages` builds them, and
then given fake storage (``to_empty`` under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`:
shapes and dtypes, no bytes), so that one micro-batch's forward and backward, the gradient
reduction and the optimizer state run as the runtime runs them, on nothing.

Ranks that hold the same stages at the same TP degree, ZeRO levels and ZeRO group size are one
*case* (:func:`rank_cases`), built at both ends of its ZeRO groups. Its figures are the bytes of
what it holds next to what the memory model predicts for it (:mod:`medley.dryrun.traced_bytes`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from medley.dryrun.traced_bytes import (
    FIGURES,
    TOLERANCE,
    ZERO_FIGURES,
    StateFigures,
    count_bytes,
    predicted,
    predicted_activations,
)
from medley.plan.plan import Plan
from medley.plan.world import World, build_world
from medley.runtime import placement
from medley.runtime.groups import RankGroups, RankTable
from medley.runtime.optim import optimizer_class
from medley.runtime.setup import build_parts
from medley.runtime.sharding import ShardedStage
from medley.runtime.tensor_parallel import local_tensor
from medley.runtime.torch_adapter import fake_store, fake_tensor_mode

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


@dataclass(frozen=True, kw_only=True)
class RankCase:
    """Ranks of a plan that build alike.

    Attributes:
        group: the replica group; pipeline_rank: their pipeline rank in it.
        stages: the global stages they run; layers: each stage's ``[first, last)`` layers.
        tp: their TP degree; levels: each stage's ZeRO level; zero_dp: their ZeRO groups' size.
        ranks: every global rank of the case (the first is the one built).
        last: the member of the first rank's ZeRO groups in the plan's last replica of them. FSDP2
            cuts each parameter's rows as ``torch.chunk`` does: where the ZeRO group's size does not
            divide them, the first members hold whole chunks (padded) and the last the remainder
            (its optimizer state less), so a case is built at both ends (:attr:`built_ranks`).
    """

    group: int
    pipeline_rank: int
    stages: tuple[int, ...]
    layers: tuple[tuple[int, int], ...]
    tp: int
    levels: tuple[int, ...]
    zero_dp: int
    ranks: tuple[int, ...]
    last: int

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def built_ranks(self) -> tuple[int, ...]:
        """The ranks a dry run builds: the first, and the last ZeRO member where ZeRO shards."""
        shards = self.zero_dp > 1 and max(self.levels) > 0
        return (self.rank, self.last) if shards and self.last != self.rank else (self.rank,)


@dataclass(frozen=True, kw_only=True)
class ParamShard:
    """One parameter as a rank holds it: global name, global and local shapes, dtype, placements."""

    name: str
    shape: tuple[int, ...]
    local: tuple[int, ...]
    dtype: str
    placements: str


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What a dry run of one rank found.

    Attributes:
        case: the rank's case; rank: the rank built.
        groups: its process groups' members by name (``pipeline``: each pipeline rank's ranks in its
            replica; ``tp``; ``zero s<i>``: the ZeRO group of each segment it holds).
        shards: every parameter it holds.
        built / predicted: its model-state bytes, counted and by the memory model.
        activations / predicted_activations: bytes one micro-batch's forward keeps for its backward
            (the tensors autograd saved on this CPU's kernels, input and output included,
            parameters not; a selective block's kept outputs live inside checkpoint's cache and are
            not seen), and the figure the compiler books for the simulator
            (:func:`medley.lowering.activations.stage_activation_bytes`). Shown, not checked: the
            formulas model a GPU's kernels.
    """

    case: RankCase
    rank: int
    groups: dict[str, list[list[int]] | list[int]]
    shards: list[ParamShard]
    built: StateFigures
    predicted: StateFigures
    activations: float
    predicted_activations: float
    stages: dict[int, ShardedStage] = field(repr=False, compare=False)
    rank_groups: RankGroups = field(repr=False, compare=False)
    mesh_ranks: dict[int, torch.Tensor] = field(repr=False, compare=False)
    mode: FakeTensorMode = field(repr=False, compare=False)

    def differences(self, tolerance: float = TOLERANCE) -> list[tuple[str, float, float]]:
        """(figure, built, predicted) of every figure off by more than ``tolerance``."""
        out = []
        for name in ("static", *FIGURES):
            built, predicted = getattr(self.built, name), getattr(self.predicted, name)
            if abs(built - predicted) > tolerance * max(abs(predicted), 1.0):
                out.append((name, built, predicted))
        return out


def rank_table(plan: Plan) -> RankTable:
    """The plan's rank table for the ranks as ``medley launch`` numbers them
    (:func:`medley.runtime.placement.started_identities`), the table a run of them builds."""
    return placement.rank_table(plan, placement.started_identities(plan))


def rank_cases(plan: Plan, world: World | None = None) -> list[RankCase]:
    """The plan's distinct ranks, in rank order of their first member."""
    world = world or build_world(plan.groups)
    table = rank_table(plan)
    cases: dict[tuple, list[int]] = {}
    keys: dict[tuple, RankCase] = {}
    last: dict[tuple, int] = {}
    for replica, row in enumerate(table):
        group, _ = world.segments.where(replica)
        layout = world.groups[group]
        schedule = world.schedules[replica]
        for k, ranks in enumerate(row):
            stages = tuple(schedule.stages_of_rank(k))
            layers = tuple((r.start, r.stop) for r in map(layout.layer_range, stages))
            levels = tuple(layout.zero[s].level for s in stages)
            key = (group, k, layers, len(ranks), levels, layout.zero_dp)
            if key not in keys:
                keys[key] = RankCase(group=group, pipeline_rank=k, stages=stages, layers=layers,
                                     tp=len(ranks), levels=levels, zero_dp=layout.zero_dp, ranks=(), last=-1)
            cases.setdefault(key, []).extend(ranks)
            last[key] = ranks[0]  # TP rank 0 of the latest replica: the first rank's ZeRO groups' last
    out = [RankCase(**{**keys[key].__dict__, "ranks": tuple(sorted(ranks)), "last": last[key]})
           for key, ranks in cases.items()]
    return sorted(out, key=lambda case: case.rank)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of a fake world of ``world_size`` (nothing is sent anywhere)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the dry run needs its own fake one")
    hook = sys.excepthook  # init_process_group prefixes it with the rank, once per world made
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _mesh_ranks(stages: dict[int, ShardedStage], groups: RankGroups) -> dict[int, torch.Tensor]:
    """The global ranks of every mesh the rank's parameters and segments use, by ``id`` of the
    mesh (a mesh reads them through the process group, which is gone after the build)."""
    meshes = [*groups.meshes.values(), *(p.device_mesh for stage in stages.values()
                                        for _, p in stage.named_parameters_local() if isinstance(p, DTensor))]
    return {id(mesh): mesh.mesh.clone() for mesh in meshes}


def _groups_of(groups: RankGroups) -> dict[str, list[list[int]] | list[int]]:
    place = groups.place
    out: dict[str, list[list[int]] | list[int]] = {
        "pipeline": [list(ranks) for ranks in groups.pipeline],
        "tp": list(groups.pipeline[place.pipeline_rank]),
    }
    for segment, mesh in sorted(groups.meshes.items()):
        out[f"zero s{segment}"] = [int(r) for r in mesh.mesh[:, place.tp_rank].tolist()]
    return out


def shards(stages: dict[int, ShardedStage]) -> list[ParamShard]:
    out = []
    for stage in stages.values():
        for name, param in stage.named_parameters_local():
            local = local_tensor(param)
            placements = ", ".join(map(str, param.placements)) if isinstance(param, DTensor) else "whole"
            out.append(ParamShard(name=name, shape=tuple(param.shape), local=tuple(local.shape),
                                  dtype=str(param.dtype).removeprefix("torch."), placements=placements))
    return out


def build_rank(plan: Plan, rank: int, *, world: World | None = None, case: RankCase | None = None,
               measure: bool = True) -> RankReport:
    """Build ``rank`` of ``plan`` alone in a fake world (collectives do nothing) as a run builds it
    (:func:`medley.runtime.setup.build_parts`, on the meta device; compile changes no module or
    shard and is left out) and count what it holds; the process group is gone again when this
    returns (the stages stay, on fake storage)."""
    world = world or build_world(plan.groups)
    if case is None:
        case = next(c for c in rank_cases(plan, world) if rank in c.ranks)
    cls, kwargs = optimizer_class("adamw", lr=1e-4, weight_decay=0.0)
    table = rank_table(plan)
    with fake_world(plan.world_size, rank):
        parts = build_parts(world, table, device=torch.device("cpu"), seed=0, optimizer_class=cls,
                            optimizer_kwargs=kwargs, materialize=False)
        layout, groups = parts.layout, parts.groups
        mode = fake_tensor_mode()
        stages = _on_fake_storage(parts.stages, mode)
        with mode:
            built, activations = count_bytes(layout, stages) if measure else (ZERO_FIGURES, 0)
        report = RankReport(case=case, rank=rank, groups=_groups_of(groups), shards=shards(stages),
                            built=built,
                            predicted=predicted(layout, case.stages), activations=float(activations),
                            predicted_activations=predicted_activations(layout, case.stages), stages=stages,
                            rank_groups=groups, mode=mode, mesh_ranks=_mesh_ranks(stages, groups))
    return report


def _on_fake_storage(stages: dict[int, ShardedStage], mode: FakeTensorMode) -> dict[int, ShardedStage]:
    """The rank's meta stages (TP and FSDP2 applied, nothing allocated) on fake storage, levels 1-2
    gathered as after a build."""
    with mode:
        for stage in stages.values():
            before = dict(stage.module.named_parameters())
            stage.module.to_empty(device="cpu")
            _rebind(stage, before)
            if stage.sharded and stage.meaning.gathers_after_step:
                stage.unshard(None)
    return stages


def _rebind(stage: ShardedStage, before: dict[str, nn.Parameter]) -> None:
    """Point the stage's buckets, optimizers and tied copies at the parameters ``to_empty`` put in
    place of the meta ones (new objects outside FSDP2, which keeps its own)."""
    after = dict(stage.module.named_parameters())
    new = {id(param): after[name] for name, param in before.items()}
    stage.buckets = [[new.get(id(p), p) for p in bucket] for bucket in stage.buckets]
    stage.copies = frozenset(new.get(id(p), p) for p in stage.copies)
    for optimizer in stage.optimizers:
        for group in optimizer.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
