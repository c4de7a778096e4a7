"""Exact figures of planner candidates: which to simulate within the budget, the simulation,
memory check, price, and the ZeRO placement knob.

Every figure comes from :func:`medley.lowering.predict.predict`, the same simulation the other commands
show.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from medley.cost.interfaces import CostSource
from medley.cost.tp_cost import TensorPricing
from medley.errors import MedleyInputError
from medley.lowering.predict import predict_groups
from medley.plan.layout import PlanLayout
from medley.plan.plan import Plan, Prediction
from medley.schedule.zero_settings import Placement
from medley.search.space import Candidate, Constraints, GroupedCandidate
from medley.sim.result import SimResult
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec

Objective = Literal["throughput", "cost"]
Progress = Callable[[str, int, int], None]
"""Told (phase, items done, items in the phase) as the search goes; presentation is the caller's."""


@dataclass(frozen=True, kw_only=True)
class RankedPlan:
    """A simulated plan with its objective figures."""

    plan: Plan
    candidate: Candidate | GroupedCandidate
    result: SimResult
    fits: bool
    cost_per_mtoken: float | None
    min_headroom_gb: float

    @property
    def prediction(self) -> Prediction:
        assert self.plan.prediction is not None
        return self.plan.prediction

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens_per_s


def rank_plan(
    candidate: Candidate | GroupedCandidate, layout: PlanLayout | Sequence[PlanLayout], cluster: Cluster,
    cost: CostSource, headroom: float, *, pricing: TensorPricing | None = None,
) -> RankedPlan:
    """Simulate ``layout`` (or the replica groups of one plan) exactly and attach the figures the
    planner ranks by (``pricing``: the search's TP pricing, :attr:`PlanContext.pricing
    <medley.search.estimate.context.PlanContext.pricing>`)."""
    groups = (layout,) if isinstance(layout, PlanLayout) else tuple(layout)
    prediction, _, result = predict_groups(groups, cluster, cost=cost, pricing=pricing)
    headrooms = [
        cluster.devices[r.device].type.memory_bytes * (1.0 - headroom) - r.peak_memory_bytes
        for r in result.devices
    ]
    used = [d for group in groups for d in group.devices]  # every TP rank is priced
    prices = [cluster.devices[d].price_per_hour for d in used]
    cost_per_mtoken = None
    if all(p is not None for p in prices) and prediction.tokens_per_s > 0:
        cost_per_mtoken = sum(prices) / 3600.0 / prediction.tokens_per_s * 1e6  # type: ignore[arg-type]
    return RankedPlan(
        plan=Plan(groups=groups, cluster=cluster, prediction=prediction),
        candidate=candidate,
        result=result,
        fits=min(headrooms) >= 0.0,
        cost_per_mtoken=cost_per_mtoken,
        min_headroom_gb=min(headrooms) / 1e9,
    )


def objective_key(plan: RankedPlan, objective: Objective) -> float:
    """Smaller is better."""
    if objective == "cost":
        return plan.cost_per_mtoken if plan.cost_per_mtoken is not None else float("inf")
    return -plan.tokens_per_s


SIMULATION_WORK = 100_000
"""Most stage-micro-batches (micro-batches x pipeline stages, summed over replicas) simulated per
search, the first candidate's included, though it is simulated whatever it costs; a small
cluster's searches stop at the candidate count first. On the planner bench's 1,024 devices one
simulation of 24 stages x 2,048 micro-batches takes about 0.5 s, and this allows 2 (GPT-3-175B) to
6 (LLaMA-2-7B) simulations there. At 60,000 the 70B and 175B searches simulated one candidate (the
second by estimate simulates 4.2% faster on 70B) and the 13B search two (a fourth gains 2.9%); at
150,000 nothing more was found."""


SMALL_CLUSTER = 64
"""Clusters up to this many devices simulate each candidate in well under a second."""
SIMULATED_SMALL = 24
SIMULATED_LARGE = 12
"""Least candidates simulated exactly on a small (large) cluster: enough that every device pool
and family among the best estimates gets a simulation, since the analytic estimate orders close
candidates wrongly by a few percent (the simulator decides)."""
SIMULATED_PER_SHOWN_SMALL = 3
SIMULATED_PER_SHOWN_LARGE = 2
"""Candidates simulated per plan shown (``--top``): each shown plan needs a few runners-up for its
rank to mean something; fewer on large clusters, whose simulations cost more."""


SIMULATE_WITHIN = 0.15
"""How far (a fraction) above the fastest simulated step a candidate's estimate may lie and still
be simulated (each device pool's best candidate is simulated regardless). On the planner bench's
synthetic clusters (16 to 256 devices, 7B to 70B, 1 to 8 sequences per device) no simulated step
was more than 7.4% below its estimate, and cutting at 15% left every best plan as it was while
simulating up to 58% fewer candidates."""


def simulation_budget(num_devices: int, top: int) -> int:
    """How many candidates at most get an exact simulation."""
    if num_devices <= SMALL_CLUSTER:
        return max(SIMULATED_SMALL, SIMULATED_PER_SHOWN_SMALL * top)
    return max(SIMULATED_LARGE, SIMULATED_PER_SHOWN_LARGE * top)


def simulation_work(candidate: Candidate) -> int:
    return sum(candidate.micro_batches) * len(candidate.stage_layers)


def choose(
    candidates: list[tuple[float, int, Candidate]], budget: int
) -> tuple[list[Candidate], list[Candidate]]:
    """The best by estimate while the count and the simulation work allow (always at least one),
    and then the best of every further device pool that still fits the work budget (so
    single-type plans are simulated too), without duplicates."""
    chosen: dict[tuple[Any, ...], Candidate] = {}
    work = 0
    for _, _, candidate in candidates:
        cost = simulation_work(candidate)
        if not chosen or (len(chosen) < budget and work + cost <= SIMULATION_WORK):
            if candidate.key not in chosen:
                chosen[candidate.key] = candidate
                work += cost
    pools_seen = {c.structure.pool for c in chosen.values()}
    pool_best: dict[tuple[Any, ...], Candidate] = {}
    for _, _, candidate in candidates:
        pool = candidate.structure.pool
        cost = simulation_work(candidate)
        if pool not in pools_seen and work + cost <= SIMULATION_WORK and candidate.key not in chosen:
            pool_best.setdefault(candidate.key, candidate)
            work += cost
            pools_seen.add(pool)
    return list(chosen.values()), list(pool_best.values())


def simulate_all(
    chosen: list[Candidate], model: ModelSpec, seq_len: int, cluster: Cluster, cost: CostSource,
    constraints: Constraints, progress: Progress | None = None, *, within: float | None = None,
    always: Collection[tuple[Any, ...]] = (), pricing: TensorPricing | None = None,
) -> list[RankedPlan]:
    """Simulate each candidate (the memory rules booked what the simulator books, so a candidate
    that overflows is dropped later, not repaired: none did on the bench's clusters). With
    ``within`` (ranking by throughput: :data:`SIMULATE_WITHIN`), a candidate whose estimate
    exceeds the fastest fitting step simulated so far by more than that fraction is skipped, unless
    its key is in ``always``: the estimate leaves out communication that the simulation adds, so
    such a plan has not been seen to simulate faster."""
    ranked: list[RankedPlan] = []
    fastest = float("inf")
    for done, candidate in enumerate(chosen, start=1):
        if progress is not None:
            progress("simulating candidates", done, len(chosen))
        far = within is not None and candidate.estimate_s > fastest * (1.0 + within)
        if far and candidate.key not in always:
            continue
        try:
            plan = rank_plan(candidate, candidate.layout(model, seq_len), cluster, cost,
                             constraints.memory_headroom, pricing=pricing)
        except MedleyInputError:  # a layout the compiler or the loader's checks refuse
            continue
        ranked.append(plan)
        if plan.fits:
            fastest = min(fastest, plan.prediction.step_time_s)
    return ranked


def simulate_grouped(
    grouped: Sequence[GroupedCandidate], model: ModelSpec, seq_len: int, cluster: Cluster, cost: CostSource,
    constraints: Constraints, progress: Progress | None = None, *, pricing: TensorPricing | None = None,
) -> list[RankedPlan]:
    """Simulate each plan of replica groups of their own shape (:mod:`medley.search.rules.asymmetric`);
    one the compiler or the loader's checks refuse is left out."""
    ranked = []
    for done, candidate in enumerate(grouped, start=1):
        if progress is not None:
            progress("simulating replica groups", done, len(grouped))
        try:
            ranked.append(rank_plan(candidate, candidate.layouts(model, seq_len), cluster, cost,
                                    constraints.memory_headroom, pricing=pricing))
        except MedleyInputError:  # groups that cannot run together
            continue
    return ranked


def best_placement(
    feasible: list[RankedPlan], top: int, cluster: Cluster, cost: CostSource, constraints: Constraints,
    objective: Objective, *, pricing: TensorPricing | None = None,
) -> list[RankedPlan]:
    """ZeRO placement is a knob too: the shown plans are simulated once more with the naive policy
    (reductions after the stage's last backward), which wins where the bubbles are too short for
    the collectives or a clipping barrier ends the step anyway; each keeps the faster policy."""
    out = []
    for i, plan in enumerate(feasible):
        groups = plan.plan.groups
        if i < top and len(plan.plan.micro_batches) > 1 and groups[0].placement is not Placement.NAIVE:
            naive_groups = [replace(g, placement=Placement.NAIVE) for g in groups]
            naive = rank_plan(plan.candidate, naive_groups, cluster, cost, constraints.memory_headroom,
                              pricing=pricing)
            if naive.fits and objective_key(naive, objective) < objective_key(plan, objective):
                plan = naive
        out.append(plan)
    order = {id(p): i for i, p in enumerate(out)}
    return sorted(out, key=lambda p: (objective_key(p, objective), order[id(p)]))
