"""Simulate a layout on its cluster and condense the result into a :class:`Prediction`.

Every figure a plan shows comes from here: the exact simulation of that plan, never a bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import CostSource, Pass
from medley.cost.tp_cost import TensorPricing
from medley.errors import MedleyInputError
from medley.lowering.compile import compile_world
from medley.plan.layout import PlanLayout
from medley.plan.plan import Prediction
from medley.schedule.validate import ScheduleError, validate
from medley.sim.engine import simulate
from medley.sim.problem import SimProblem
from medley.sim.result import SimResult
from medley.spec.cluster import Cluster

GB = 1e9

_VALID_PROGRAMS: set[tuple[str, int, int, str]] = set()
"""(family, pp, micro-batches, knobs) of the generated programs that validated. Validation reads
only the compute and point-to-point actions, which the ZeRO placement keeps in the generator's
order, and the generators are deterministic: one check per program serves every plan that runs
it (a search simulates many plans of the same few programs)."""


def simulate_layout(
    layout: PlanLayout, cluster: Cluster, *, cost: CostSource | None = None, comm: bool = True,
    where: str | None = None,
) -> tuple[SimProblem, SimResult]:
    """Validate the layout's schedules, then simulate one step (catalog costs unless given); with
    ``where`` (the input it came from), refuse a step of too many actions first (compile_world)."""
    return simulate_groups((layout,), cluster, cost=cost, comm=comm, where=where)


def simulate_groups(
    groups: Sequence[PlanLayout], cluster: Cluster, *, cost: CostSource | None = None, comm: bool = True,
    where: str | None = None, pricing: TensorPricing | None = None,
) -> tuple[SimProblem, SimResult]:
    """:func:`simulate_layout` for a plan of replica groups (:mod:`medley.plan.segments`);
    ``pricing``: as for :func:`~medley.lowering.compile.compile_world`."""
    first = groups[0]
    if cost is None:
        cost = CatalogCostSource.for_cluster(first.model, cluster, dtype=first.dtype)
    problem = compile_world(groups, cluster, cost, comm=comm, where=where, pricing=pricing)
    # Replicas with the same micro-batch count run the same program: check each distinct one once
    # (a thousand replicas need not be validated a thousand times), and once per process.
    replicas = [(layout, r) for layout in groups for r in range(layout.dp)]
    for replica, (schedule, (layout, local)) in enumerate(zip(problem.schedules, replicas, strict=True)):
        knobs = repr(sorted(layout.knobs.items()))
        program = (layout.schedule, layout.pp, layout.micro_batches[local], knobs)
        if program in _VALID_PROGRAMS:
            continue
        try:
            validate(schedule)
        except ScheduleError as err:
            raise MedleyInputError(f"replica {replica}'s schedule is invalid: {err}") from None
        _VALID_PROGRAMS.add(program)
    return problem, simulate(problem)


def layer_sources(layout: PlanLayout | Sequence[PlanLayout], cluster: Cluster,
                  cost: CostSource) -> dict[str, dict[str, str]]:
    """Where each layer kind's times came from (``catalog``, ``profile:FILE``, ...), per device
    type of the plan (a layout, or the replica groups of one plan); a type that also runs stages
    of tensor-parallel degree T > 1 has an entry ``TYPE tpT``: a block's time there is the
    source's own measurement at that degree (a Metis ``_tpT_`` file) where it has one, else the
    degree-1 time scaled (``... scaled to tpT``), as the compiler takes it."""
    groups = (layout,) if isinstance(layout, PlanLayout) else tuple(layout)
    first = groups[0]
    layers = {first.model.layer_kind(i): i for i in (0, 1, first.model.num_layers - 1)}
    at = {"micro_batch_size": first.micro_batch_size, "seq_len": first.seq_len}
    used = dict.fromkeys((cluster.devices[d].type.name, group.tp_of(k)) for group in groups
                         for row in group.assignment for k, d in enumerate(row))
    out: dict[str, dict[str, str]] = {}
    for name, _ in used:
        out.setdefault(name, {kind: cost.layer_time(layer, Pass.F, device_type=name, **at).source
                              for kind, layer in layers.items()})
    for name, tp in used:
        if tp == 1:
            continue
        entry = {}
        for kind, layer in layers.items():
            own = cost.tp_layer_time(layer, Pass.F, device_type=name, tp=tp, **at)
            entry[kind] = own.source if own is not None else f"{out[name][kind]} scaled to tp{tp}"
        out[f"{name} tp{tp}"] = entry
    return out


def cost_source_name(layout: PlanLayout | Sequence[PlanLayout], cost: CostSource, cluster: Cluster) -> str:
    """All the sources the plan's per-layer times came from, joined by '+'."""
    names = {s.split(" scaled to tp")[0] for by_kind in layer_sources(layout, cluster, cost).values()
             for s in by_kind.values()}
    return "+".join(sorted(names))


def prediction_of(result: SimResult, *, cost_source: str) -> Prediction:
    reports = result.devices
    return Prediction(
        step_time_s=result.step_time_s,
        tokens_per_s=result.tokens_per_s,
        mfu=result.mfu,
        bubble_fraction=sum(r.bubble_fraction for r in reports) / len(reports),
        exposed_comm_s=sum(r.exposed_comm_s for r in reports) / len(reports),
        peak_memory_gb={r.device: r.peak_memory_bytes / GB for r in reports},
        cost_source=cost_source,
    )


def predict(
    layout: PlanLayout, cluster: Cluster, *, cost: CostSource | None = None, comm: bool = True
) -> tuple[Prediction, SimProblem, SimResult]:
    """Simulate ``layout`` and return its prediction with the problem and result behind it."""
    return predict_groups((layout,), cluster, cost=cost, comm=comm)


def predict_groups(
    groups: Sequence[PlanLayout], cluster: Cluster, *, cost: CostSource | None = None, comm: bool = True,
    pricing: TensorPricing | None = None,
) -> tuple[Prediction, SimProblem, SimResult]:
    """:func:`predict` for a plan of replica groups (``pricing``: as for :func:`simulate_groups`)."""
    first = groups[0]
    if cost is None:
        cost = CatalogCostSource.for_cluster(first.model, cluster, dtype=first.dtype)
    problem, result = simulate_groups(groups, cluster, cost=cost, comm=comm, pricing=pricing)
    return prediction_of(result, cost_source=cost_source_name(groups, cost, cluster)), problem, result
