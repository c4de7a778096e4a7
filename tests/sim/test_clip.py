"""Gradient clipping in the IR: one world-wide CLIP gates every optimizer step, in the simulator."""

from __future__ import annotations

from dataclasses import replace

from medley.cost.estimator import CatalogCostSource
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.plan.world import build_schedules
from medley.schedule.ir import Action, Kind
from medley.schedule.validate import validate
from medley.sim.engine import simulate
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


def _layout(clip: bool):
    cluster = parse_cluster_arg("4xA100-80GB+4xV100-32GB")
    model = get_model("llama-2-7b")
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=4, dp=2,
        schedule="1f1b", micro_batches="8,6", micro_batch_size=1, seq_len=1024, zero="1,2,3,0",
    )
    return replace(layout, clip_grad=clip), cluster, CatalogCostSource.for_cluster(model, cluster)


def test_clip_gates_every_optimizer_step_behind_the_last_reduction_anywhere() -> None:
    layout, cluster, cost = _layout(clip=True)
    problem = compile_problem(layout, cluster, cost)
    for schedule in problem.schedules:
        validate(schedule)
    result = simulate(problem)
    clips = [(start, end) for _, start, end, a in result.collectives if a.kind is Kind.CLIP]
    assert len(clips) == 1  # one instance spanning all eight devices
    clip_start, clip_end = clips[0]
    members = next(m for m, _, _, a in result.collectives if a.kind is Kind.CLIP)
    assert sorted(members) == list(range(8))
    last_reduction = max(end for _, _, end, a in result.collectives if a.kind is Kind.REDUCE_GRAD)
    assert clip_start >= last_reduction - 1e-12
    optim_starts = [s for rows in result.compute.values() for s, _, a in rows if a.kind is Kind.OPTIM]
    assert optim_starts and min(optim_starts) >= clip_end - 1e-12


def test_clipping_costs_time_and_round_trips_as_text() -> None:
    clipped, cluster, cost = _layout(clip=True)
    free, _, _ = _layout(clip=False)
    assert simulate(compile_problem(clipped, cluster, cost)).step_time_s >= simulate(
        compile_problem(free, cluster, cost)
    ).step_time_s
    row = build_schedules(clipped)[0].actions[2]
    assert Action(2, Kind.CLIP) in row and Action.parse("2CLIP") == Action(2, Kind.CLIP)
