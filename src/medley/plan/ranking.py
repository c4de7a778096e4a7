"""Exact figures of planner candidates: simulate, check memory, price, and repair what overflows.

Every figure comes from :func:`medley.plan.predict.predict`, the same simulation the other commands
show.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from medley.cost.interfaces import CostSource
from medley.plan.bounds import memory_options
from medley.plan.compile import PlanLayout
from medley.plan.plan import Plan, Prediction
from medley.plan.predict import predict
from medley.plan.space import Candidate
from medley.sim.result import SimResult
from medley.spec.cluster import Cluster

Objective = Literal["throughput", "cost"]


@dataclass(frozen=True, kw_only=True)
class RankedPlan:
    """A simulated plan with its objective figures."""

    plan: Plan
    candidate: Candidate
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
    candidate: Candidate, layout: PlanLayout, cluster: Cluster, cost: CostSource, headroom: float
) -> RankedPlan:
    """Simulate ``layout`` exactly and attach the figures the planner ranks by."""
    prediction, _, result = predict(layout, cluster, cost=cost)
    headrooms = [
        cluster.devices[r.device].type.memory_bytes * (1.0 - headroom) - r.peak_memory_bytes
        for r in result.devices
    ]
    used = [d for row in layout.assignment for d in row]
    prices = [cluster.devices[d].price_per_hour for d in used]
    cost_per_mtoken = None
    if all(p is not None for p in prices) and prediction.tokens_per_s > 0:
        cost_per_mtoken = sum(prices) / 3600.0 / prediction.tokens_per_s * 1e6  # type: ignore[arg-type]
    return RankedPlan(
        plan=Plan(layout=layout, cluster=cluster, prediction=prediction),
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


def repair(plan: RankedPlan, headroom: float) -> Candidate | None:
    candidate, layout, cluster = plan.candidate, plan.plan.layout, plan.plan.cluster
    over_ranks = {
        report.rank
        for report in plan.result.devices
        if report.peak_memory_bytes > cluster.devices[report.device].type.memory_bytes * (1.0 - headroom)
    }
    ladder = memory_options(layout.dp)
    options = list(candidate.options)
    changed = False
    for stage, option in enumerate(options):
        if stage % layout.pp in over_ranks and option in ladder and ladder.index(option) + 1 < len(ladder):
            options[stage] = ladder[ladder.index(option) + 1]
            changed = True
    if not changed:
        return None
    return replace(candidate, options=tuple(options), estimate_s=float("nan"))


class progress_bar:
    """A rich progress bar on stderr when asked for (and a no-op otherwise)."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        self.enabled, self.label, self.total = enabled, label, total
        self._bar: Progress | None = None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._bar.__enter__()
        task = self._bar.add_task(self.label, total=self.total)
        bar = self._bar
        return lambda: bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
