"""The baselines take their systems' shapes, and the ablation's constrained searches are real
searches that cannot beat the unconstrained one on these instances."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from medley.search.estimate.bounds import memory_options
from medley.search.planner import search
from medley.search.rank.baselines import (
    NAMES,
    fastest_type_only,
    megatron_lm_style,
    megatron_structures,
    metis_style,
    one_option_for_all,
    run_baselines,
)
from medley.search.report.ablation import STEPS, ablate
from medley.search.rules.builder import balanced_micro_batches, build
from medley.search.rules.candidates import Estimator
from medley.search.rules.memory_rules import cheapest_per_stage
from medley.search.rules.split_rules import bottleneck
from medley.search.rules.tp_structures import tp_degrees
from medley.search.space import Constraints
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.toml"


def _estimator(cluster: str, model: str, global_batch: int, seq_len: int) -> Estimator:
    from medley.cost.estimator import CatalogCostSource

    spec = parse_cluster_arg(cluster)
    m = get_model(model)
    return Estimator(spec, m, CatalogCostSource.for_cluster(m, spec), seq_len=seq_len,
                     global_batch=global_batch, memory_headroom=0.05)


def _types(est: Estimator, assignment: tuple[tuple[int, ...], ...]) -> set[str]:
    return {est.cluster.devices[d].type.name for row in assignment for d in row}


def test_megatron_grid_is_cluster_order_with_equal_micro_batches() -> None:
    est = _estimator("4xA100-80GB+4xV100-32GB", "tiny", 32, 128)
    structures = list(megatron_structures(est, range(8), (1, 2), Constraints()))
    assert {st.pp for st in structures if st.tp == ()} == {1, 2, 3, 4, 5, 6}
    # TP within a node of one type: every degree the tiny model's heads divide.
    assert {st.tp_of(0) for st in structures} == set(tp_degrees(est, range(8))) == {1, 2}
    for st in structures:
        micro_batches = est.global_batch // st.micro_batch_size
        tp = st.tp_of(0)
        assert micro_batches % st.dp == 0 and st.num_devices <= 8 and set(st.tp or (1,)) == {tp}
        # Megatron's rank order: tp fastest, then dp, then pp over the devices in cluster order.
        assert all(st.assignment[r][k] == (k * st.dp + r) * tp for r in range(st.dp) for k in range(st.pp))
        for lead in (d for row in st.assignment for d in row):  # groups on one node, of one type
            group = [est.cluster.devices[d] for d in range(lead, lead + tp)]
            assert len({(d.node, d.type.name) for d in group}) == 1
    plan = megatron_lm_style(est, range(8), (1, 2), Constraints())
    assert plan is not None
    lay = plan.plan.layout
    assert lay.schedule in ("1f1b", "interleaved") and len(set(lay.micro_batches)) == 1
    assert max(lay.stage_layers) - min(lay.stage_layers) <= 1
    assert {z.level for z in lay.zero} == {1 if lay.dp > 1 else 0} and len(set(lay.recompute)) == 1


def test_each_baseline_has_its_shape_on_a_mixed_cluster() -> None:
    est = _estimator("4xH100-SXM-80GB+4xA100-80GB", "llama-2-7b", 32, 2048)
    plans = run_baselines(est, range(8), (1, 2, 4), Constraints())
    assert tuple(plans) == NAMES and all(p is not None for p in plans.values())
    one_type = plans["megatron-lm-style-one-type"]
    assert one_type is not None and len(_types(est, one_type.plan.layout.assignment)) == 1
    fastest = plans["fastest-type-only"]
    assert fastest is not None and _types(est, fastest.plan.layout.assignment) == {"H100-SXM-80GB"}
    metis = plans["metis-style"]
    assert metis is not None
    lay = metis.plan.layout
    assert lay.schedule == "1f1b" and lay.placement.value == "naive" and len(set(lay.zero)) == 1
    # Stage groups follow one order of the device types: each type occupies one run of stages.
    stage_types = [sorted({est.cluster.devices[row[k]].type.name for row in lay.assignment})
                   for k in range(lay.pp)]
    runs = [t for k, t in enumerate(stage_types) if k == 0 or t != stage_types[k - 1]]
    assert len(runs) == len({tuple(t) for t in runs})
    # Each baseline is the best of its own space: every single-type Megatron run is no faster.
    for ids in (range(4), range(4, 8)):
        single = megatron_lm_style(est, ids, (1, 2, 4), Constraints())
        assert single is None or single.tokens_per_s <= one_type.tokens_per_s
    assert metis_style(est, range(8), (1, 2, 4), Constraints()) is not None
    assert fastest_type_only(est, range(4), (1, 2, 4), Constraints()) is not None


def test_one_option_for_all_takes_the_most_saving_stage_option() -> None:
    est = _estimator(str(DEMO), "llama-2-7b", 24, 2048)
    pools = {"all": list(range(est.cluster.num_devices))}
    mixed = 0
    for st in est.structures(pools, max_pp=4, micro_batch_sizes=(1,)):
        rules = {"split": bottleneck, "micro_batches": balanced_micro_batches()}
        ladder_only = functools.partial(cheapest_per_stage, finer=False)  # the baselines' all-or-nothing
        per_stage = build(est, st, "1f1b", memory=ladder_only, **rules)
        uniform_fit = build(est, st, "1f1b", memory=one_option_for_all(), **rules)
        if per_stage is None:
            continue
        assert uniform_fit is not None
        if uniform_fit.stage_layers != per_stage.stage_layers:
            continue  # the bottleneck split saw other memory options and moved layers
        ladder = memory_options(st.dp)
        assert set(uniform_fit.options) == {max(per_stage.options, key=ladder.index)}
        mixed += len(set(per_stage.options)) > 1
    assert mixed  # the instance has structures whose stages take different options


@pytest.mark.parametrize(
    ("cluster", "model", "global_batch", "seq_len"),
    [("4xA100-80GB+4xV100-32GB", "tiny", 32, 128), ("4xH100-SXM-80GB+4xA100-80GB", "llama-2-7b", 32, 2048)],
)
def test_ablation_steps_are_constrained_searches_no_faster_than_the_best(
    cluster: str, model: str, global_batch: int, seq_len: int
) -> None:
    result = search(parse_cluster_arg(cluster), get_model(model), global_batch=global_batch,
                    seq_len=seq_len, top=1)
    ablation = ablate(result)
    assert [s.name for s in ablation.steps] == list(STEPS)
    best = result.best.prediction.step_time_s
    assert ablation.best_step_s == best
    for step in ablation.steps:
        assert step.plan is not None and step.step_time_s == step.plan.prediction.step_time_s
        assert step.step_time_s >= best * (1 - 1e-9), step.name
    schedule = ablation.steps[0]
    assert schedule.plan is not None and schedule.plan.plan.layout.schedule == "1f1b"
    assert schedule.step_time_s is not None and schedule.step_time_s > best  # the schedule matters here
    heterogeneity = ablation.steps[1].plan
    assert heterogeneity is not None
    lay = heterogeneity.plan.layout
    assert max(lay.micro_batches) - min(lay.micro_batches) <= 1
    assert max(lay.stage_layers) - min(lay.stage_layers) <= 1
    zero = ablation.steps[2].plan
    assert zero is not None and len(set(zero.candidate.options)) == 1  # one option (buckets cap at layers)
    assert zero.plan.layout.placement.value == "naive"
    tp_one = ablation.steps[3].plan
    assert tp_one is not None and set(tp_one.plan.layout.tp) <= {1}
    if set(result.best.plan.layout.tp) <= {1}:  # the best plan is in the constrained space
        assert tp_one.tokens_per_s == pytest.approx(result.best.tokens_per_s)
    if ablation.baseline_step_s is not None and ablation.baseline_step_s > best:
        for step in ablation.steps:
            assert step.step_time_s is not None and step.share_of_gain is not None
            expected = math.log(step.step_time_s / best) / math.log(ablation.baseline_step_s / best)
            assert step.share_of_gain == pytest.approx(expected)
