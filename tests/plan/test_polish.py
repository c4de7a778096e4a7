"""Polishing the best simulated plan (:mod:`medley.plan.polish`): one layer moved into a stage
with slack, which the estimate cannot rank and the simulation can."""

from __future__ import annotations

import pytest

from medley.plan import polish as polish_module
from medley.plan.candidates import Estimator
from medley.plan.polish import rank_times, slack_moves
from medley.plan.search import search
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

CLUSTER = "8xH100-SXM-80GB+8xA100-80GB"
MODEL = get_model("llama-2-7b")


def _search(rounds: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(polish_module, "POLISH_ROUNDS", rounds)
    return search(parse_cluster_arg(CLUSTER), MODEL, global_batch=32, seq_len=4096, top=1, baselines=False)


def test_polish_finds_a_faster_split_one_layer_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without polishing, the best plan's two A100 stages hold 4 and 3 layers (the head counts as
    one); the simulation prefers 3 and 4, which the estimate ties."""
    before = _search(0, monkeypatch).best
    after = _search(3, monkeypatch).best
    assert after.tokens_per_s > before.tokens_per_s * 1.002
    old, new = before.plan.layout.stage_layers, after.plan.layout.stage_layers
    assert sum(abs(a - b) for a, b in zip(old, new, strict=True)) == 2  # one layer moved
    assert [z.level for z in after.plan.layout.zero] == [z.level for z in before.plan.layout.zero]
    assert after.plan.layout.micro_batches == before.plan.layout.micro_batches


def test_slack_moves_keep_the_bottleneck_and_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _search(0, monkeypatch)
    cluster = parse_cluster_arg(CLUSTER)
    est = Estimator(cluster, MODEL, result.cost, seq_len=4096, global_batch=32, memory_headroom=0.05)
    best = result.best.candidate
    limit = max(rank_times(est, best, best.stage_layers))
    moves = list(slack_moves(est, best))
    assert moves
    for move in moves:
        assert max(rank_times(est, move, move.stage_layers)) <= limit * (1 + 1e-9)
        assert sum(move.stage_layers) == sum(best.stage_layers)
        assert move.options == best.options and move.micro_batches == best.micro_batches
    polished = result.simulated[-len(moves):]
    assert all(p.fits for p in polished)  # the memory rule booked what the simulator books
