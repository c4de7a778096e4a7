"""A fidelity case and its plan: the case as written (:class:`FidelityCase`), its emulated
cluster (:func:`emulate`), its plan as replica groups (written out, or ``medley plan``'s search on
that cluster: :func:`case_groups`) and the simulator's prediction of it (:func:`build_plan`).
:mod:`medley.fidelity.loop` runs it for real against that prediction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medley.cost.profile_format import Profile
from medley.fidelity.emulate import EmulatedCluster, core_share, emulated_cluster
from medley.lowering.predict import predict_groups
from medley.plan.inline import devices_needed, inline_layout, parse_tp
from medley.plan.layout import PlanLayout
from medley.plan.plan import Plan
from medley.plan.segments import joined
from medley.spec.model import ModelSpec

PLANNER_MICRO_BATCH_SIZES = (1, 2)  # what the planner may choose for planned cases (all profiled)


@dataclass(frozen=True, kw_only=True)
class FidelityCase:
    """One plan to predict and run.

    Attributes:
        name: label in the report.
        model: the model (``tiny`` or a small one).
        pp, dp: pipeline ranks per replica, replicas (planned cases: ignored, the planner's).
        schedule: schedule family; virtual_stages for interleaved; warmup: hetero-1F1B's
            in-flight depth per stage (empty: 1F1B's).
        split: blocks (or layers) per stage, as ``--split`` takes it; None: balanced by speed.
        zero: ZeRO level per stage, as ``--zero`` takes it.
        micro_batches: per replica, as ``--micro-batches`` takes it (``"6,2"`` for uneven).
        micro_batch_size, seq_len: the shape of a micro-batch.
        slowdowns: emulated slowdown of each device (device ``k*dp + r`` runs replica r's rank k).
        buckets: ZeRO layer buckets per stage; gather_windows: ZeRO-3 gather rounds (0 streams).
        recompute: blocks recompute their forward before the backward (full); recompute_mode:
            the text of ``--recompute-mode`` (``selective``, ``full:1``, one per stage), which wins.
        clip_grad: clip gradients by their global norm (the runtime clips at norm 1.0).
        dtype: ``fp32``, or ``bf16`` (the runtime computes under CPU autocast; the simulator
            reads a bf16 profile and the bf16 memory model).
        from_planner: take the planner's plan of this rank (1 = best) for ``global_batch``
            sequences on the emulated cluster instead of the fields above (0: not planned).
        global_batch: sequences per step the planner plans for.
        tp: tensor-parallel degree per pipeline rank, as ``--tp`` takes it (``"2"``, ``"2,1"``;
            None: no TP). Each TP group's devices form one emulated node.
        groups: replica groups of their own shape (:mod:`medley.plan.segments`), each a dict of
            the fields above that a group chooses (``pp``, ``dp``, ``schedule``, ``split``,
            ``zero``, ``micro_batches``; no TP), on consecutive devices in group order; the
            case's own pp, dp, split, zero and micro_batches are then unused.
    """

    name: str
    model: ModelSpec
    pp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    split: str | None = None
    zero: str | None = None
    micro_batches: str = "4"
    micro_batch_size: int = 2
    seq_len: int = 128
    slowdowns: tuple[float, ...] = ()
    virtual_stages: int = 2
    warmup: tuple[int, ...] = ()
    buckets: int = 1
    gather_windows: int = 1
    recompute: bool = False
    recompute_mode: str | None = None
    clip_grad: bool = False
    dtype: str = "fp32"
    from_planner: int = 0
    global_batch: int = 8
    tp: str | None = None
    groups: tuple[dict[str, Any], ...] = ()

    @property
    def degrees(self) -> tuple[int, ...]:
        """The TP degree of each pipeline rank (1 each without ``tp``)."""
        return parse_tp(self.tp, pp=self.pp) or (1,) * self.pp

    @property
    def world(self) -> int:
        if self.groups:
            return sum(int(g["pp"]) * int(g.get("dp", 1)) for g in self.groups)
        return len(self.slowdowns) if self.from_planner else devices_needed(pp=self.pp, dp=self.dp,
                                                                             tp=self.degrees)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        """Devices per emulated node in id order: one TP group each (the inline layout's
        :func:`~medley.plan.inline.default_assignment` puts rank k's dp groups side by side)."""
        if self.from_planner or self.groups:
            return ()
        return tuple(t for t in self.degrees for _ in range(self.dp))

    @property
    def profile_sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes the case's profile must cover."""
        return PLANNER_MICRO_BATCH_SIZES if self.from_planner else (self.micro_batch_size,)


def describe(layout: PlanLayout | Sequence[PlanLayout], slowdowns: Sequence[float] = ()) -> str:
    """The plan in words, from its layout or replica groups (what ran, whoever chose it)."""
    if not isinstance(layout, PlanLayout):
        groups = tuple(layout)
        if len(groups) > 1:
            return " + ".join(f"[{describe(g)}]" for g in groups) + (
                "" if all(f == 1.0 for f in slowdowns) else ", slow " + ",".join(f"{f:g}" for f in slowdowns))
        layout = groups[0]
    counts = sorted(set(layout.micro_batches))
    mb = ",".join(map(str, layout.micro_batches)) if len(counts) > 1 else str(counts[0])
    parts = [
        f"pp{layout.pp} dp{layout.dp}" + (f" tp{','.join(map(str, layout.tp))}" if layout.tp else ""),
        layout.schedule,
        f"mb {mb}x{layout.micro_batch_size}",
        f"seq {layout.seq_len}",
        "layers " + ",".join(map(str, layout.stage_layers)),
        "ZeRO " + ",".join(str(z.level) for z in layout.zero),
    ]
    if warmup := layout.knobs.get("warmup"):
        parts.append("warmup " + ",".join(map(str, warmup)))
    if any(z.buckets > 1 for z in layout.zero):
        parts.append("buckets " + ",".join(str(z.buckets) for z in layout.zero))
    if any(z.streams for z in layout.zero):
        parts.append("streamed")
    if any(layout.recompute):
        modes = [str(r) for r in layout.recompute]
        parts.append("recompute" if set(modes) == {"full"} else "recompute " + ",".join(modes))
    if layout.clip_grad:
        parts.append("clip")
    parts.append(layout.dtype)
    if any(f != 1.0 for f in slowdowns):
        parts.append("slow " + ",".join(f"{f:g}" for f in slowdowns))
    return ", ".join(parts)


def tags(layout: PlanLayout | Sequence[PlanLayout], case: FidelityCase) -> list[str]:
    """What a plan exercises, as labels the report groups errors by."""
    if not isinstance(layout, PlanLayout):
        groups = tuple(layout)
        if len(groups) > 1:
            inner = dict.fromkeys(t for g in groups for t in tags(g, case) if not t.endswith(" ranks"))
            ranks = sum(g.world_size for g in groups)
            return [f"{ranks} ranks", "replica groups", "data parallel", *inner]
        layout = groups[0]
    out = [f"{layout.world_size} ranks", layout.schedule, layout.dtype]
    out += ["pipeline"] if layout.pp > 1 else []
    out += ["tensor parallel"] if layout.tp else []
    out += ["data parallel"] if layout.dp > 1 else []
    levels = {z.level for z in layout.zero} if layout.dp > 1 else set()
    out += [f"ZeRO-{level}" for level in sorted(levels)]
    out += ["streamed ZeRO-3"] if layout.dp > 1 and any(z.streams for z in layout.zero) else []
    out += ["buckets > 1"] if any(z.buckets > 1 for z in layout.zero) else []
    out += ["recompute"] if any(layout.recompute) else []
    out += ["clip"] if layout.clip_grad else []
    out += ["uneven replicas"] if len(set(layout.micro_batches)) > 1 else []
    out += ["emulated slow ranks"] if any(f != 1.0 for f in case.slowdowns) else []
    out += ["planner's plan"] if case.from_planner else []
    return out


def emulate(
    case: FidelityCase,
    profile: Profile,
    *,
    profile_name: str,
    directory: Path,
    cores: int,
    background_cores: float = 0.0,
    used: Sequence[int] = (),
) -> tuple[EmulatedCluster, float]:
    """The case's emulated cluster and the compute stretch of its ranks sharing ``cores``
    with ``background_cores`` of other work (:func:`~medley.fidelity.emulate.core_share`). Only
    the devices in ``used`` (default: all) run ranks (a planner's plan may leave some out)."""
    slowdowns = case.slowdowns or (1.0,) * case.world
    if len(slowdowns) != case.world:
        raise ValueError(f"case {case.name}: {len(slowdowns)} slowdowns for {case.world} devices")
    ranks = [slowdowns[d] for d in used] if used else slowdowns
    share = core_share(ranks, cores=cores, background_cores=background_cores)
    emulated = emulated_cluster(
        profile,
        case.model,
        slowdowns,
        directory=directory,
        profile_name=profile_name,
        compute_share=share,
        name=f"emu-{case.name}",
        node_sizes=case.node_sizes,
    )
    return emulated, share


class NotRanked(ValueError):
    """A planner case asks for the k-th plan of a search that ranked fewer (its pruning kept
    fewer candidates within reach of the best): the case is skipped and the report says so."""


def case_groups(case: FidelityCase, emulated: EmulatedCluster) -> tuple[PlanLayout, ...]:
    """The case's plan as replica groups: written out (one group, or ``case.groups``), or the
    planner's (``medley plan``'s search) on ``emulated``."""
    if case.from_planner:
        from medley.search.planner import Constraints, search

        result = search(
            emulated.cluster,
            case.model,
            global_batch=case.global_batch,
            seq_len=case.seq_len,
            cost=emulated.cost,
            top=case.from_planner,
            constraints=Constraints(micro_batch_sizes=PLANNER_MICRO_BATCH_SIZES),
        )
        if len(result.plans) < case.from_planner:
            raise NotRanked(f"the planner ranked only {len(result.plans)} plan(s), not {case.from_planner}")
        groups = result.plans[case.from_planner - 1].plan.groups
        return joined([dataclasses.replace(layout, dtype=case.dtype) for layout in groups])
    if case.groups:
        layouts, first = [], 0
        for spec in case.groups:
            layout = _inline(dataclasses.replace(case, groups=(), tp=None, **spec), emulated)
            order = sorted(layout.devices)
            moved = {d: first + order.index(d) for d in order}
            layouts.append(dataclasses.replace(
                layout, assignment=tuple(tuple(moved[d] for d in row) for row in layout.assignment)))
            first += len(order)
        return joined(layouts)
    return (_inline(case, emulated),)


def _inline(case: FidelityCase, emulated: EmulatedCluster) -> PlanLayout:
    layout = inline_layout(
        cluster=emulated.cluster,
        model=case.model,
        cost=emulated.cost,
        pp=case.pp,
        dp=case.dp,
        schedule=case.schedule,
        micro_batches=case.micro_batches,
        micro_batch_size=case.micro_batch_size,
        seq_len=case.seq_len,
        virtual_stages=case.virtual_stages,
        split=case.split,
        zero=case.zero,
        buckets=case.buckets,
        gather_windows=case.gather_windows,
        recompute=case.recompute,
        recompute_mode=case.recompute_mode,
        dtype=case.dtype,
        clip_grad=case.clip_grad,
        tp=case.tp,
    )
    if case.warmup:
        layout = dataclasses.replace(layout, knobs={**layout.knobs, "warmup": tuple(case.warmup)})
    return layout


def build_plan(
    case: FidelityCase,
    profile: Profile,
    *,
    profile_name: str,
    directory: Path,
    cores: int,
    background_cores: float = 0.0,
) -> tuple[Plan, float]:
    """The case's plan on its emulated cluster with the simulator's prediction, and the ranks'
    compute stretch (see :func:`emulate`)."""
    emulated, share = emulate(
        case,
        profile,
        profile_name=profile_name,
        directory=directory,
        cores=cores,
        background_cores=background_cores,
    )
    groups = case_groups(case, emulated)
    prediction, _, _ = predict_groups(groups, emulated.cluster, cost=emulated.cost)
    return Plan(groups=groups, cluster=emulated.cluster, prediction=prediction), share
