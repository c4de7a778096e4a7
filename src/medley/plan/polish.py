"""Polishing the best simulated plan: one layer moved between neighbouring pipeline stages.

The split rules balance every stage's F+B+W to the bottleneck's. Where several splits tie (the
stages with slack, typically the slower devices' short ones, can take the last layers in several
ways), the analytic estimate cannot tell them apart, but the exact simulation can: where a stage
sits in a 1F1B or zero-bubble schedule decides how much of its time lies on the critical path of
the fill and the drain (on the planner bench's mixed clusters, moving one layer between two A100
stages made some best plans a few percent faster). So the best simulated plan's neighbours that
move one layer into a rank with slack (no rank's estimated time grows past the bottleneck's)
are simulated, the best that improves is kept, and this repeats for up to
:data:`POLISH_ROUNDS` rounds while the simulation work stays within :data:`POLISH_WORK`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import accumulate

from medley.cost.interfaces import CostSource
from medley.plan import builder, memory_rules
from medley.plan.context import PlanContext
from medley.plan.ranking import Objective, RankedPlan, objective_key, rank_plan, simulation_work
from medley.plan.space import Candidate, Constraints
from medley.spec.cluster import Cluster

POLISH_ROUNDS = 3
POLISHED_FAMILIES = ("1f1b", "zb-h1", "hetero-1f1b", "gpipe")
POLISH_WORK = 20_000
"""Most stage-micro-batches simulated while polishing (a third of
:data:`medley.plan.ranking.SIMULATION_WORK`): a handful of simulations on up to 256 devices, none
where one simulation of the plan costs more."""


def rank_times(ctx: PlanContext, candidate: Candidate, split: Sequence[int]) -> list[float]:
    """Each pipeline rank's F+B+W seconds per micro-batch under ``split`` (its stages summed; the
    slowest replica's device types), as the estimate sees them."""
    st = candidate.structure
    starts = [0, *accumulate(split)]
    out = [0.0] * st.pp
    for signature, _ in ctx.signatures(st):
        per_rank = [0.0] * st.pp
        for s in range(len(split)):
            k = s % st.pp
            table = ctx.table(signature[k], st.micro_batch_size, tp=st.tp_of(k))
            per_rank[k] += table.time(starts[s], starts[s + 1], recompute=candidate.options[s].recompute)
        out = [max(a, b) for a, b in zip(out, per_rank, strict=True)]
    return out


def slack_moves(ctx: PlanContext, candidate: Candidate) -> Iterator[Candidate]:
    """The candidate with one layer moved across one stage boundary into a stage that stays at or
    under the bottleneck stage's time and fits under its memory option (rebuilt by
    :func:`medley.plan.builder.build`, so the estimate and the warm-up follow the new split).
    Families with one stage per rank only (interleaved and two-direction schedules are left)."""
    if candidate.family not in POLISHED_FAMILIES:
        return
    split = candidate.stage_layers
    limit = max(rank_times(ctx, candidate, split)) * (1.0 + 1e-9)
    for b in range(len(split) - 1):
        for give, take in ((b, b + 1), (b + 1, b)):
            if split[give] < 2:
                continue
            moved = list(split)
            moved[give] -= 1
            moved[take] += 1
            if max(rank_times(ctx, candidate, moved)) > limit:
                continue
            rebuilt = builder.build(
                ctx, candidate.structure, candidate.family,
                split=lambda setting, moved=tuple(moved): moved,
                memory=memory_rules.given(candidate.options),
                micro_batches=builder.given_micro_batches(candidate.micro_batches),
            )
            if rebuilt is not None:
                yield rebuilt


def polish(
    best: RankedPlan, ctx: PlanContext, cluster: Cluster, cost: CostSource, constraints: Constraints,
    objective: Objective,
) -> list[RankedPlan]:
    """Every plan simulated while polishing ``best`` (each round's neighbours, in order), so that
    the caller ranks them with the others; ``best`` itself is not among them."""
    simulated: list[RankedPlan] = []
    seen = {best.candidate.stage_layers}
    work = 0
    current = best
    for _ in range(POLISH_ROUNDS):
        better = None
        for neighbour in slack_moves(ctx, current.candidate):
            if neighbour.stage_layers in seen:
                continue
            work += simulation_work(neighbour)
            if work > POLISH_WORK:
                return simulated
            seen.add(neighbour.stage_layers)
            layout = neighbour.layout(ctx.model, ctx.seq_len)
            layout = replace(layout, placement=current.plan.layout.placement)
            try:
                plan = rank_plan(neighbour, layout, cluster, cost, constraints.memory_headroom)
            except ValueError:  # a layout the compiler refuses
                continue
            simulated.append(plan)
            if plan.fits and objective_key(plan, objective) < objective_key(better or current, objective):
                better = plan
        if better is None:
            break
        current = better
    return simulated
