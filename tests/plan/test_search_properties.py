"""Invariants of the planner on random small clusters: every plan it returns validates, fits in
memory, uses every layer exactly once, and the search is deterministic. Plus the analytic pieces
(bottleneck split against brute force, micro-batch distribution) and the baselines' definitions."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from medley.lowering.predict import predict
from medley.plan.world import build_world
from medley.schedule.validate import validate
from medley.search.planner import Constraints, search
from medley.search.rank.baselines import NAMES
from medley.search.report.explain import explain
from medley.search.rules.sweep import bottleneck_split
from medley.search.space import distribute
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

TINY = get_model("tiny")
TYPES = ["A100-80GB", "V100-32GB", "T4-16GB"]

clusters = st.lists(st.tuples(st.integers(1, 3), st.sampled_from(TYPES)), min_size=1, max_size=3).map(
    lambda terms: "+".join(f"{n}x{t}" for n, t in terms)
)


def _signature(result) -> list[tuple]:
    return [
        (
            tuple((g.assignment, g.stage_layers, g.schedule, g.micro_batches, g.micro_batch_size, g.zero)
                  for g in p.plan.groups),
            p.prediction.step_time_s,
        )
        for p in result.plans
    ]


@settings(max_examples=30, deadline=None)
@given(cluster=clusters, global_batch=st.sampled_from([4, 6, 8, 16]), seq_len=st.sampled_from([32, 64]))
def test_every_returned_plan_is_valid_fits_and_covers_each_layer_once(cluster, global_batch, seq_len) -> None:
    spec = parse_cluster_arg(cluster)
    constraints = Constraints(schedules=("1f1b", "zb-h1", "interleaved", "hetero-1f1b", "gpipe"))
    result = search(
        spec,
        TINY,
        global_batch=global_batch,
        seq_len=seq_len,
        top=4,
        constraints=constraints,
        baselines=False,
    )
    assert result.plans
    for ranked in result.plans:
        for schedule in build_world(ranked.plan.groups).schedules:  # replica groups of their own shape too
            validate(schedule)
        for layout in ranked.plan.groups:
            covered = [layer for stage in range(layout.num_stages) for layer in layout.layer_range(stage)]
            assert sorted(covered) == list(range(TINY.num_layers))
        assert sum(ranked.plan.micro_batches) * ranked.plan.shared.micro_batch_size == global_batch
        used = list(ranked.plan.devices)
        assert len(set(used)) == len(used)
        for report in ranked.result.devices:
            capacity = spec.devices[report.device].type.memory_bytes * (1 - constraints.memory_headroom)
            assert report.peak_memory_bytes <= capacity
        assert ranked.fits
    speeds = [p.tokens_per_s for p in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    again = search(
        spec,
        TINY,
        global_batch=global_batch,
        seq_len=seq_len,
        top=4,
        constraints=constraints,
        baselines=False,
    )
    assert _signature(again) == _signature(result)


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 9), min_size=2, max_size=8),
    stages=st.integers(1, 4),
    speed=st.lists(st.sampled_from([1, 2, 3]), min_size=4, max_size=4),
)
def test_bottleneck_split_matches_brute_force(costs, stages, speed) -> None:
    n = len(costs)
    if stages > n:
        return
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_time(s: int, i: int, j: int) -> float:
        return (prefix[j] - prefix[i]) / speed[s]

    def stage_end(s: int, i: int, t: float) -> int:
        j = i
        while j < n and stage_time(s, i, j + 1) <= t:
            j += 1
        return j

    found = bottleneck_split(n, stages, stage_end, lo=0.0, hi=float(sum(costs)) + 1.0, iterations=60)
    assert found is not None
    split, _ = found
    best = min(
        max(stage_time(s, a, b) for s, (a, b) in enumerate(zip((0, *cuts), (*cuts, n), strict=True)))
        for cuts in combinations(range(1, n), stages - 1)
    )
    starts = [sum(split[:s]) for s in range(stages)]
    got = max(stage_time(s, starts[s], starts[s] + split[s]) for s in range(stages))
    assert sum(split) == n and min(split) >= 1
    assert got <= best * (1 + 3e-3)


@given(total=st.integers(1, 200), weights=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=12))
def test_distribute_gives_everyone_one_and_follows_the_weights(total, weights) -> None:
    if total < len(weights):
        return
    counts = distribute(total, weights)
    assert sum(counts) == total and min(counts) >= 1
    for a in range(len(weights)):
        for b in range(len(weights)):
            if weights[a] > weights[b]:
                assert counts[a] >= counts[b] - 1


def test_baselines_follow_their_definitions() -> None:
    spec = parse_cluster_arg("2xA100-80GB+2xV100-32GB")
    result = search(spec, TINY, global_batch=16, seq_len=64, top=1)
    assert tuple(result.baselines) == NAMES
    for name in ("megatron-lm-style-one-type", "megatron-lm-style-all-devices"):
        megatron = result.baselines[name]
        assert megatron is not None, name
        lay = megatron.plan.layout
        assert lay.schedule in ("1f1b", "interleaved") and len(set(lay.micro_batches)) == 1
        assert max(lay.stage_layers) - min(lay.stage_layers) <= 1
        assert all(z.level == (1 if lay.dp > 1 else 0) for z in lay.zero)
    one_type = result.baselines["megatron-lm-style-one-type"]
    assert one_type is not None
    assert len({spec.devices[d].type.name for row in one_type.plan.layout.assignment for d in row}) == 1
    fastest = result.baselines["fastest-type-only"]
    assert fastest is not None
    assert {spec.devices[d].type.name for row in fastest.plan.layout.assignment for d in row} == {"A100-80GB"}
    metis = result.baselines["metis-style"]
    assert metis is not None and metis.plan.layout.placement.value == "naive"
    assert metis.plan.layout.schedule == "1f1b"
    assert result.best.tokens_per_s >= max(b.tokens_per_s for b in result.baselines.values() if b)


def test_ranked_figures_are_predicts_and_explain_names_the_knobs() -> None:
    spec = parse_cluster_arg("2xA100-80GB+2xT4-16GB")
    result = search(spec, TINY, global_batch=32, seq_len=128, top=3)
    for ranked in result.plans:
        prediction, _, _ = predict(ranked.plan.layout, spec, cost=result.cost)
        assert prediction == ranked.prediction
    text = "\n".join(explain(result).lines())
    assert "Bottleneck: device" in text and "Fraction of the aggregate bound" in text
    for name in result.baselines:
        assert f"vs {name}:" in text
