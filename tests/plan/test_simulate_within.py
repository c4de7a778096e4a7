"""The search skips simulating candidates whose estimate lies far above the fastest step already
simulated (:data:`medley.plan.ranking.SIMULATE_WITHIN`): fewer simulations, the same best plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from medley.plan import ranking
from medley.plan.search import search
from medley.spec.cluster_load import load_cluster, parse_cluster_arg
from medley.spec.model_arg import get_model

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("cluster", ["8xH100-SXM-80GB+8xA100-80GB", "4xA100-80GB+4xV100-32GB+4xT4-16GB"])
def test_skipping_far_estimates_keeps_the_best_plan(cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, model = parse_cluster_arg(cluster), get_model("llama-2-7b")
    monkeypatch.setattr(ranking, "SIMULATE_WITHIN", float("inf"))
    every = search(spec, model, global_batch=64, seq_len=2048, top=1, baselines=False)
    monkeypatch.setattr(ranking, "SIMULATE_WITHIN", 0.15)
    pruned = search(spec, model, global_batch=64, seq_len=2048, top=1, baselines=False)
    assert pruned.best.plan.layout == every.best.plan.layout
    assert len(pruned.simulated) < len(every.simulated)
    fastest = min(p.prediction.step_time_s for p in pruned.simulated if p.fits)
    kept = {p.candidate.key for p in pruned.simulated}
    skipped = [p for p in every.simulated if p.candidate.key not in kept]
    assert all(p.candidate.estimate_s > fastest * 1.15 for p in skipped)


def test_cost_ranking_simulates_every_chosen_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate is a step time, not a cost per token: ranking by cost skips nothing."""
    spec, model = load_cluster(EXAMPLES / "demo.toml"), get_model("llama-2-7b")
    monkeypatch.setattr(ranking, "SIMULATE_WITHIN", float("inf"))
    every = search(spec, model, global_batch=64, seq_len=2048, top=1, baselines=False, objective="cost")
    monkeypatch.setattr(ranking, "SIMULATE_WITHIN", 0.0)
    pruned = search(spec, model, global_batch=64, seq_len=2048, top=1, baselines=False, objective="cost")
    assert len(pruned.simulated) == len(every.simulated)
