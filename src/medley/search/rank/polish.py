"""Polishing the best simulated plan: one layer moved between neighbouring pipeline stages.

The split rules balance every stage's F+B+W to the bottleneck's. Where several splits tie (the
stages with slack, typically the slower devices' short ones, can take the last layers in several
ways), the analytic estimate cannot tell them apart, but the exact simulation can: where a stage
sits in a 1F1B or zero-bubble schedule decides how much of its time lies on the critical path of
the fill and the drain (on the planner bench's mixed clusters, moving one layer between two A100
stages made some best plans a few percent faster). So the best simulated plan's neighbours that
move one layer across a stage boundary without raising the estimate (:data:`POLISH_TIE`) are
simulated, the best that improves is kept, and this repeats for up to :data:`POLISH_ROUNDS`
rounds while the simulation work stays within :data:`POLISH_WORK`. A runner-up simulated within
:data:`POLISH_WITHIN` of the best may overtake it once polished, so the search polishes the first
:data:`POLISH_STARTS` such plans, best first, on one work budget (:func:`polish_leaders`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from medley.cost.interfaces import CostSource
from medley.search.estimate.context import PlanContext
from medley.search.rank.ranking import Objective, RankedPlan, objective_key, rank_plan, simulation_work
from medley.search.rules import builder, memory_rules
from medley.search.space import Candidate, Constraints
from medley.spec.cluster import Cluster

POLISH_ROUNDS = 3
POLISHED_FAMILIES = ("1f1b", "zb-h1", "hetero-1f1b", "gpipe")
"""Families with one stage per rank (interleaved chunks and two-direction chains are left)."""
POLISH_TIE = 1e-6
"""How much (a fraction) a neighbour's estimate may exceed the plan's and still count as a tie."""
POLISH_WORK = 20_000
"""Most stage-micro-batches simulated while polishing (in the units of
:data:`medley.search.rank.ranking.SIMULATION_WORK`): a handful of simulations on up to 256 devices, none
where one simulation of the plan costs more."""
POLISH_WITHIN = 0.03
"""Plans simulated within this fraction of the best are polished too. Polishing moved the planner
bench's best plans by 0.5-4.3% (1% or less in four of five cases), so a runner-up this close can
overtake; a wider window would spend the work budget on plans that rarely do."""
POLISH_STARTS = 3
"""Most plans polished per search (the best and its closest runners-up)."""


@dataclass(kw_only=True)
class PolishWork:
    """Stage-micro-batches the polishing may still simulate (shared by every plan polished)."""

    left: int = field(default_factory=lambda: POLISH_WORK)  # read when made: tests vary it


def tied_moves(ctx: PlanContext, candidate: Candidate) -> Iterator[Candidate]:
    """The candidate with one layer moved across one stage boundary, rebuilt by
    :func:`medley.search.rules.builder.build` (the estimate, the warm-up and each stage's fit under its
    kept memory option follow the new split), where the estimate does not rise."""
    if candidate.family not in POLISHED_FAMILIES:
        return
    split = candidate.stage_layers
    for b in range(len(split) - 1):
        for give, take in ((b, b + 1), (b + 1, b)):
            if split[give] < 2:
                continue
            moved = list(split)
            moved[give] -= 1
            moved[take] += 1
            rebuilt = builder.build(
                ctx, candidate.structure, candidate.family,
                split=lambda setting, moved=tuple(moved): moved,
                memory=memory_rules.given(candidate.options),
                micro_batches=builder.given_micro_batches(candidate.micro_batches),
            )
            if rebuilt is not None and rebuilt.estimate_s <= candidate.estimate_s * (1.0 + POLISH_TIE):
                yield rebuilt


def polish_leaders(
    ranked: list[RankedPlan], ctx: PlanContext, cluster: Cluster, cost: CostSource,
    constraints: Constraints, objective: Objective, simulated: set[tuple[object, ...]],
) -> list[RankedPlan]:
    """:func:`polish` from each of the first :data:`POLISH_STARTS` of ``ranked`` (feasible plans,
    best first) within :data:`POLISH_WITHIN` of the best, on one :class:`PolishWork`; the plans
    that improved on the best so far, in the order found (the last is the best found). A runner-up
    polished short of the best is dropped: near-copies of it would crowd the ranking's top."""
    if not ranked:
        return []
    first = objective_key(ranked[0], objective)
    starts = [p for p in ranked[:POLISH_STARTS]
              if objective_key(p, objective) <= first + abs(first) * POLISH_WITHIN]
    work, leader, kept = PolishWork(), ranked[0], []
    for start in starts:
        for plan in polish(start, ctx, cluster, cost, constraints, objective, simulated, work):
            if objective_key(plan, objective) < objective_key(leader, objective):
                kept.append(plan)
                leader = plan
    return kept


def polish(
    best: RankedPlan, ctx: PlanContext, cluster: Cluster, cost: CostSource, constraints: Constraints,
    objective: Objective, simulated: set[tuple[object, ...]], work: PolishWork | None = None,
) -> list[RankedPlan]:
    """The plans that improved on ``best`` round by round (the last is the best found; empty when
    none did). ``simulated``: the keys of the candidates simulated already (not simulated again;
    the neighbours simulated here are added); ``work``: what may still be simulated (a fresh
    :data:`POLISH_WORK` when not given)."""
    improved: list[RankedPlan] = []
    work = work if work is not None else PolishWork()
    current = best
    for _ in range(POLISH_ROUNDS):
        better = None
        for neighbour in tied_moves(ctx, current.candidate):
            if neighbour.key in simulated:
                continue
            work.left -= simulation_work(neighbour)
            if work.left < 0:
                return improved
            simulated.add(neighbour.key)
            # The plan's own collective placement (the ablation's constrained searches fix it).
            layout = neighbour.layout(ctx.model, ctx.seq_len)
            layout = replace(layout, placement=current.plan.layout.placement)
            try:
                plan = rank_plan(neighbour, layout, cluster, cost, constraints.memory_headroom,
                                 pricing=ctx.pricing)
            except ValueError:  # a layout the compiler refuses
                continue
            if plan.fits and objective_key(plan, objective) < objective_key(better or current, objective):
                better = plan
        if better is None:
            break
        improved.append(better)
        current = better
    return improved
