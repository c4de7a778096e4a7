"""Polishing the best simulated plan (:mod:`medley.plan.polish`): one layer moved where the
estimate ties, which the simulation can rank."""

from __future__ import annotations

import pytest

from medley.plan import polish as polish_module
from medley.plan.candidates import Estimator
from medley.plan.polish import polish, tied_moves
from medley.plan.search import search
from medley.plan.space import Constraints
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

CLUSTER = "8xH100-SXM-80GB+8xA100-80GB"
MODEL = get_model("llama-2-7b")


def _search(rounds: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(polish_module, "POLISH_ROUNDS", rounds)
    # Without TP: the polish case is a plan without it (a tp2 interleaved plan is 1.3% faster here).
    return search(parse_cluster_arg(CLUSTER), MODEL, global_batch=32, seq_len=4096, top=3, baselines=False,
                  constraints=Constraints(tp_degrees=(1,)))


def _estimator(result) -> Estimator:
    return Estimator(result.cluster, MODEL, result.cost, seq_len=4096, global_batch=32, memory_headroom=0.05)


def test_polish_finds_a_faster_split_one_layer_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without polishing, the best plan's two A100 stages hold 4 and 3 layers (the head counts as
    one); the simulation prefers 3 and 4, which the estimate ties."""
    before = _search(0, monkeypatch)
    after = _search(3, monkeypatch)
    assert after.best.tokens_per_s > before.best.tokens_per_s * 1.002
    old, new = before.best.plan.layout.stage_layers, after.best.plan.layout.stage_layers
    assert sum(abs(a - b) for a, b in zip(old, new, strict=True)) == 2  # one layer moved
    assert [z.level for z in after.best.plan.layout.zero] == [z.level for z in before.best.plan.layout.zero]
    assert after.best.plan.layout.micro_batches == before.best.plan.layout.micro_batches
    # Only plans that improved join the ranking: the runners-up are the search's own.
    finalists = {p.candidate.key for p in before.simulated}
    assert [p.candidate.key for p in after.simulated if p.candidate.key not in finalists] == [
        after.best.candidate.key]


def test_tied_moves_keep_the_estimate_and_polished_plans_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _search(0, monkeypatch)
    est, best = _estimator(result), result.best
    moves = list(tied_moves(est, best.candidate))
    assert moves
    for move in moves:
        assert move.estimate_s <= best.candidate.estimate_s * (1 + 1e-6)
        assert sum(move.stage_layers) == sum(best.candidate.stage_layers)
        assert move.options == best.candidate.options
        assert move.micro_batches == best.candidate.micro_batches
    monkeypatch.setattr(polish_module, "POLISH_ROUNDS", 3)
    seen = {p.candidate.key for p in result.simulated}
    improved = polish(best, est, result.cluster, result.cost, result.constraints, "throughput", seen)
    assert improved and all(p.fits for p in improved)  # the memory rule booked what the simulator books
    speeds = [best.tokens_per_s, *(p.tokens_per_s for p in improved)]
    assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)
    assert {m.key for m in moves} <= seen  # every neighbour tried is marked simulated


def test_interleaved_plans_are_not_polished(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _search(0, monkeypatch)
    interleaved = next(p for p in result.simulated if p.plan.layout.schedule == "interleaved")
    assert list(tied_moves(_estimator(result), interleaved.candidate)) == []
