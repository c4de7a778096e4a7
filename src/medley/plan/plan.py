"""The plan file: everything the runtime needs to run a plan, and what the simulator predicted.

A plan is a :class:`PlanLayout` (model, rectangle of devices, split, schedule, micro-batches, ZeRO
and recomputation per stage) plus the cluster it was made for (embedded, so the file stands
alone) and the predicted figures with the cost source they came from. The TOML form is versioned;
:func:`load_plan` validates every field and names the one to fix, :func:`save_plan` writes
atomically so that a crash never leaves half a plan behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import BaseModel, Field, ValidationError

from medley.cost.recompute import FULL, NONE, parse_recompute
from medley.errors import MedleyInputError
from medley.fileio import read_toml, write_atomically
from medley.plan.layout import PlanLayout, check_tp
from medley.plan.segments import joined
from medley.plan.world import build_world, step_actions
from medley.schedule.zero_settings import Placement, StageZero
from medley.spec.adapter import LoraSpec
from medley.spec.catalog import check_precision
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.cluster_schema import STRICT, describe_validation_error, printable
from medley.spec.limits import (
    MAX_BLOCKS,
    MAX_MICRO_BATCHES,
    MAX_SIM_WORK,
    MAX_SIZE,
    MAX_WINDOWS,
    check_sim_actions,
    check_sim_work,
)
from medley.spec.model import PRESETS, ModelSpec, model_from_dict

PLAN_VERSION = 2  # 1: one group of alike replicas in [layout]; 2: [[layout.replicas]] groups
MAX_GROUPS = 1_024
PLAN_DOC = "docs/plan-format.md"
_Knob = int | list[int]


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the simulator predicts for one step of the plan.

    Attributes:
        step_time_s: simulated step time.
        tokens_per_s: tokens of the global batch per simulated second.
        mfu: model FLOPs utilisation against the dense peaks of the devices used.
        bubble_fraction: mean share of the step the devices wait for other pipeline stages or
            replicas (pipeline fill and drain, waits at collectives for slower members).
        exposed_comm_s: mean time per device idle while its own communication runs (transfers
            past the producer's finish, ZeRO collectives, the gradient-norm CLIP all-reduce).
        peak_memory_gb: simulated peak memory of each device used, by device id.
        cost_source: where the per-layer times came from (catalog estimate or a profile file).
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    exposed_comm_s: float
    peak_memory_gb: dict[int, float]
    cost_source: str


@dataclass(frozen=True, kw_only=True, init=False)
class Plan:
    """A runnable plan: its replica groups, the cluster it targets and (optionally) its prediction.

    Attributes:
        groups: the replica groups (:mod:`medley.plan.segments`): one for a plan of alike replicas
            (``Plan(layout=...)``), several where replicas have pipelines of their own shape, each
            told the plan's replica count (``sync_dp``).
        cluster: the cluster the plan was made for.
        prediction: the simulated figures, if known.
    """

    groups: tuple[PlanLayout, ...]
    cluster: Cluster
    prediction: Prediction | None

    def __init__(self, *, cluster: Cluster, layout: PlanLayout | None = None,
                 groups: Sequence[PlanLayout] | None = None, prediction: Prediction | None = None) -> None:
        # ``layout`` wins, so that ``dataclasses.replace(plan, layout=...)`` (which passes the
        # groups too) makes a plan of that one layout.
        if layout is None and not groups:
            raise ValueError("give a Plan its layout or its replica groups")
        object.__setattr__(self, "groups", joined((layout,) if layout is not None else tuple(groups or ())))
        object.__setattr__(self, "cluster", cluster)
        object.__setattr__(self, "prediction", prediction)

    @property
    def layout(self) -> PlanLayout:
        """The layout of a plan of alike replicas (one group); an asymmetric plan has none."""
        if len(self.groups) != 1:
            raise ValueError(f"this plan has {len(self.groups)} replica groups of their own shape; read "
                             "Plan.groups (code that reads Plan.layout handles alike replicas only)")
        return self.groups[0]

    @property
    def asymmetric(self) -> bool:
        return len(self.groups) > 1

    @property
    def world_size(self) -> int:
        return sum(layout.world_size for layout in self.groups)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the plan uses, group by group (:attr:`PlanLayout.devices` each)."""
        return tuple(d for layout in self.groups for d in layout.devices)

    @property
    def shared(self) -> PlanLayout:
        """A layout to read what every group shares from (model, micro-batch size, sequence
        length, placement, dtype, clipping: :data:`medley.plan.segments.SHARED_FIELDS`)."""
        return self.groups[0]

    @property
    def replicas(self) -> tuple[tuple[PlanLayout, int], ...]:
        """(group layout, replica inside the group) of each global replica, in order."""
        return tuple((layout, r) for layout in self.groups for r in range(layout.dp))

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """Micro-batches of each global replica per step."""
        return tuple(m for layout in self.groups for m in layout.micro_batches)

    @property
    def sequences_per_step(self) -> int:
        """Sequences of the global batch (every replica group's)."""
        return sum(layout.sequences_per_step for layout in self.groups)

    @property
    def tokens_per_step(self) -> int:
        return sum(layout.tokens_per_step for layout in self.groups)


class _ZeroSpec(BaseModel):
    model_config = STRICT
    level: int = Field(ge=0, le=3)
    buckets: int = Field(default=1, ge=1, le=MAX_BLOCKS)
    gather_windows: int = Field(default=1, ge=0, le=MAX_WINDOWS)
    grad_windows: int = Field(default=1, ge=1, le=MAX_WINDOWS)


class _GroupSpec(BaseModel):
    """What one group of alike replicas fixes (a version-2 ``[[layout.replicas]]`` entry)."""

    model_config = STRICT
    pp: int = Field(ge=1, le=MAX_BLOCKS + 2)
    dp: int = Field(ge=1)
    assignment: list[list[int]] = Field(min_length=1)
    stage_layers: list[int] = Field(min_length=1)
    schedule: str
    knobs: dict[str, _Knob] = {}
    micro_batches: list[Annotated[int, Field(ge=1, le=MAX_MICRO_BATCHES)]] = Field(min_length=1)
    zero: list[_ZeroSpec] = Field(min_length=1)
    recompute: list[bool] = []
    recompute_mode: list[Annotated[str, Field(max_length=32)]] = []  # per stage, medley.cost.recompute
    tp: list[int] = []


class _AdapterSpec(BaseModel):
    """A plan's LoRA adapter (:class:`medley.spec.adapter.LoraSpec`)."""

    model_config = STRICT
    rank: int = Field(ge=1, le=MAX_SIZE)
    alpha: float = Field(gt=0, le=1e6)
    dropout: float = Field(ge=0, lt=1)
    targets: list[Literal["wq", "wk", "wv", "wo", "gate", "up", "down"]] = Field(min_length=1, max_length=7)


class _SharedSpec(BaseModel):
    """What every replica of a plan shares."""

    model_config = STRICT
    micro_batch_size: int = Field(ge=1, le=MAX_SIZE)
    seq_len: int = Field(ge=1, le=MAX_SIZE)
    placement: Literal["naive", "bubble"] = "bubble"
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    clip_grad: bool = False
    sequence_parallel: bool = False
    adapter: _AdapterSpec | None = None


class _LayoutSpec(_GroupSpec, _SharedSpec):
    """Version 1: one group of alike replicas, in one table."""


class _ReplicasSpec(_SharedSpec):
    """Version 2: the shared fields and the groups."""

    replicas: list[_GroupSpec] = Field(min_length=1, max_length=MAX_GROUPS)


class _PredictionSpec(BaseModel):
    model_config = STRICT
    step_time_s: float = Field(gt=0)
    tokens_per_s: float = Field(ge=0)
    mfu: float = Field(ge=0)
    bubble_fraction: float = Field(ge=0)
    exposed_comm_s: float = Field(ge=0)
    peak_memory_gb: dict[Annotated[str, Field(pattern=r"^[0-9]{1,5}$")], float] = {}
    cost_source: str = "catalog"


class _PlanFile(BaseModel):
    model_config = STRICT
    version: Literal[1]
    model: dict[str, Any]
    cluster: dict[str, Any]
    layout: _LayoutSpec
    prediction: _PredictionSpec | None = None


class _PlanFileV2(_PlanFile):
    version: Literal[2]  # type: ignore[assignment]
    layout: _ReplicasSpec  # type: ignore[assignment]


def _group_dict(layout: PlanLayout) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pp": layout.pp,
        "dp": layout.dp,
        "assignment": [list(row) for row in layout.assignment],
        "stage_layers": list(layout.stage_layers),
        "schedule": layout.schedule,
        "knobs": dict(layout.knobs),
        "micro_batches": list(layout.micro_batches),
        "zero": [dataclasses.asdict(z) for z in layout.zero],
        "recompute": [bool(r) for r in layout.recompute],
    }
    if any(r not in (NONE, FULL) for r in layout.recompute):
        out["recompute_mode"] = [str(r) for r in layout.recompute]
    if layout.tp:
        out["tp"] = list(layout.tp)
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain TOML-ready data (inverse of :func:`plan_from_dict`): version 1 for alike
    replicas, version 2 (``[[layout.replicas]]``) for replica groups of their own shape."""
    first = plan.groups[0]
    if plan.cluster.source_spec is None:
        raise ValueError("the plan's cluster was not built from a cluster spec and cannot be embedded")
    model = {k: v for k, v in dataclasses.asdict(first.model).items() if v is not None}
    shared = {"micro_batch_size": first.micro_batch_size, "seq_len": first.seq_len,
              "placement": first.placement.value, "dtype": first.dtype, "clip_grad": first.clip_grad}
    if first.sequence_parallel:  # optional: plans without it read as before
        shared["sequence_parallel"] = True
    if first.adapter is not None:
        shared["adapter"] = first.adapter.as_json()
    if plan.asymmetric:
        version, layout = PLAN_VERSION, {**shared, "replicas": [_group_dict(g) for g in plan.groups]}
    else:
        version, layout = 1, {**_group_dict(first), **shared}
    out: dict[str, Any] = {"version": version, "model": model, "cluster": plan.cluster.source_spec,
                           "layout": layout}
    if plan.prediction is not None:
        pred = dataclasses.asdict(plan.prediction)
        pred["peak_memory_gb"] = {str(k): v for k, v in plan.prediction.peak_memory_gb.items()}
        out["prediction"] = pred
    return out


def plan_from_dict(raw: dict[str, Any], *, source: str) -> Plan:
    """Validate parsed plan contents; every problem names ``source``, the field and the fix."""
    version = raw.get("version") if isinstance(raw, dict) else None
    if version not in (1, PLAN_VERSION) or isinstance(version, bool):
        raise MedleyInputError(
            f"{source}: field 'version' is {printable(repr(version))}; this medley reads plan versions "
            f"1 and {PLAN_VERSION}. "
            "Re-create the plan with `medley plan` (or set version = 1 in a hand-written plan)."
        )
    try:
        spec = (_PlanFile if version == 1 else _PlanFileV2).model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, source, doc=PLAN_DOC)) from None
    model = _model_from_dict(spec.model, source)
    cluster = cluster_from_dict(spec.cluster, source=f"{source} [cluster]")
    if isinstance(spec.layout, _ReplicasSpec):
        shared = _SharedSpec.model_validate(spec.layout.model_dump(exclude={"replicas"}))
        groups = [_layout_from_spec(group, shared, model, cluster, source, where=f"layout.replicas[{g}]")
                  for g, group in enumerate(spec.layout.replicas)]
    else:
        groups = [_layout_from_spec(spec.layout, spec.layout, model, cluster, source, where="layout")]
    _check_groups(groups, source)
    check_precision(spec.layout.dtype, cluster.device_types(d for g in groups for d in g.devices).values(),
                    where=f"{source}: field 'layout.dtype' = \"bf16\"",
                    fix='set dtype = "fp16" (or "fp32"), or plan for devices that have bf16')
    prediction = None
    if spec.prediction is not None:
        p = spec.prediction.model_dump()
        p["peak_memory_gb"] = {int(k): v for k, v in p["peak_memory_gb"].items()}
        prediction = Prediction(**p)
    return Plan(groups=groups, cluster=cluster, prediction=prediction)


def _check_groups(groups: list[PlanLayout], source: str) -> None:
    """The groups as one plan: each device used once, the schedules built together (their
    segments agree and the programs run together: :func:`medley.plan.world.build_world`)."""
    used = [d for layout in groups for d in layout.devices]
    if len(set(used)) != len(used):
        twice = next(d for d in used if used.count(d) > 1)
        raise MedleyInputError(f"{source}: table 'layout': device {twice} is used by two replicas; "
                               "give each replica group devices of its own")
    work = sum(layout.num_stages * sum(layout.micro_batches) for layout in groups)
    if work > MAX_SIM_WORK:
        raise MedleyInputError(
            f"{source}: field 'layout.replicas': {work:,} stage-micro-batches to simulate (stages x "
            f"micro-batches, every group); the limit is {MAX_SIM_WORK:,}: use fewer micro-batches, "
            "stages or replicas.")
    try:
        check_sim_actions(step_actions(build_world(joined(groups)).schedules), where="the step")
    except MedleyInputError as err:
        raise MedleyInputError(f"{source}: table 'layout': {err}") from None


def _model_from_dict(raw: dict[str, Any], source: str) -> ModelSpec:
    if set(raw) == {"name"}:  # a hand-written plan may name a preset only
        preset = PRESETS.get(str(raw["name"]).lower())
        if preset is None:
            raise MedleyInputError(printable(
                f"{source}: field 'model.name' = {raw['name']!r} is not a preset ({', '.join(PRESETS)}); "
                "name a preset or give every model field"
            ))
        return preset
    return model_from_dict(raw, source=f"{source} [model]", doc=PLAN_DOC)


def _layout_from_spec(spec: _GroupSpec, shared: _SharedSpec, model: ModelSpec, cluster: Cluster,
                      source: str, *, where: str) -> PlanLayout:
    def fail(field_name: str, problem: str, fix: str) -> MedleyInputError:
        return MedleyInputError(f"{source}: field '{where}.{field_name}': {problem}; {fix}")

    if len(spec.assignment) != spec.dp or any(len(row) != spec.pp for row in spec.assignment):
        raise fail("assignment", f"must be {spec.dp} rows (dp) of {spec.pp} device ids (pp)", "fix its shape")
    used = [d for row in spec.assignment for d in row]
    if any(not 0 <= d < cluster.num_devices for d in used) or len(set(used)) != len(used):
        raise fail("assignment", f"device ids must be distinct and in 0..{cluster.num_devices - 1}",
                   "name each device of the cluster at most once")
    if len(spec.micro_batches) != spec.dp or min(spec.micro_batches) < 1:
        raise fail("micro_batches", f"needs {spec.dp} counts (one per replica), each >= 1", "fix the list")
    stages = len(spec.stage_layers)
    if len(spec.zero) != stages:
        raise fail("zero", f"has {len(spec.zero)} entries for {stages} stages", "give one per stage")
    if spec.recompute and len(spec.recompute) != stages:
        raise fail("recompute", f"has {len(spec.recompute)} entries for {stages} stages",
                   "give one per stage")
    if spec.recompute_mode and len(spec.recompute_mode) != stages:
        raise fail("recompute_mode", f"has {len(spec.recompute_mode)} entries for {stages} stages",
                   "give one per stage")
    try:
        recompute = tuple(parse_recompute(r, where="recompute_mode")
                          for r in spec.recompute_mode or spec.recompute)
    except MedleyInputError as err:
        raise MedleyInputError(f"{source}: table '{where}': {err}") from None
    if min(spec.stage_layers) < 1:
        raise fail("stage_layers", "every stage needs at least one layer", "move layers into the empty stage")
    held = sum(spec.stage_layers) // (2 if spec.schedule == "bidirectional" else 1)
    if held != model.num_layers:
        raise fail("stage_layers", f"sums to {held} layers but {model.name} has {model.num_layers} "
                   "(embedding and head count as layers)", "make the split cover every layer once")
    _check_size(spec, source, where)
    layout = PlanLayout(
        model=model,
        pp=spec.pp,
        dp=spec.dp,
        assignment=tuple(tuple(row) for row in spec.assignment),
        stage_layers=tuple(spec.stage_layers),
        schedule=spec.schedule,
        micro_batches=tuple(spec.micro_batches),
        micro_batch_size=shared.micro_batch_size,
        seq_len=shared.seq_len,
        zero=tuple(StageZero(**z.model_dump()) for z in spec.zero),
        placement=Placement(shared.placement),
        recompute=recompute,
        dtype=shared.dtype,
        knobs=dict(spec.knobs),
        clip_grad=shared.clip_grad,
        tp=tuple(spec.tp),
        sequence_parallel=shared.sequence_parallel,
        adapter=None if shared.adapter is None else LoraSpec(
            rank=shared.adapter.rank, alpha=shared.adapter.alpha, dropout=shared.adapter.dropout,
            targets=tuple(dict.fromkeys(shared.adapter.targets))),
    )
    try:
        model.check_seq_len(layout.seq_len, field="seq_len")
        check_tp(layout, cluster)
    except MedleyInputError as err:
        raise MedleyInputError(f"{source}: table '{where}': {err}") from None
    return layout


def _check_size(spec: _GroupSpec, source: str, where: str) -> None:
    """Refuse knobs and sizes whose schedule would take more than seconds to build and simulate."""
    for name, value in spec.knobs.items():
        values = value if isinstance(value, list) else [value]
        if len(values) > MAX_BLOCKS + 2 or any(not 0 <= v <= MAX_MICRO_BATCHES for v in values):
            raise MedleyInputError(printable(
                f"{source}: field '{where}.knobs.{name}': {value!r} is out of range; use integers in "
                f"0..{MAX_MICRO_BATCHES:,} (at most {MAX_BLOCKS + 2} of them)"
            ))
    virtual = spec.knobs.get("virtual_stages", 1)
    stages = max(len(spec.stage_layers), spec.pp * (virtual if isinstance(virtual, int) else 1))
    check_sim_work(stages=stages, micro_batches=spec.micro_batches, where=f"{source}: field '{where}'")


def save_plan(plan: Plan, path: Path) -> None:
    """Write ``plan`` as TOML; the file appears whole or not at all."""
    write_atomically(Path(path), tomli_w.dumps(plan_to_dict(plan)))


def load_plan(path: Path) -> Plan:
    """Read and validate a plan file; every problem is a :class:`MedleyInputError`."""
    return plan_from_dict(read_toml(path, what="plan"), source=str(path))
