"""Polishing the best simulated plan (:mod:`medley.search.rank.polish`): one layer moved where the
estimate ties, which the simulation can rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from medley.search.planner import search
from medley.search.rank import polish as polish_module
from medley.search.rank.polish import polish, polish_leaders, tied_moves
from medley.search.rules.candidates import Estimator
from medley.search.space import Constraints
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

CLUSTER = "8xA100-80GB+8xT4-16GB"
# Sequence length of the scenario (the calibrated catalog, bench/published_fit.py, made the former
# one, H100 + V100 at 4,096, tie every neighbour of its best plan).
SEQ = 2048
MODEL = get_model("llama-2-7b")
# Families with one stage per rank (interleaved plans, which are not polished, are faster here).
POLISHED = ("1f1b", "zb-h1", "hetero-1f1b", "gpipe")


def _search(rounds: int, monkeypatch: pytest.MonkeyPatch, schedules: tuple[str, ...] = POLISHED):
    monkeypatch.setattr(polish_module, "POLISH_ROUNDS", rounds)
    return search(parse_cluster_arg(CLUSTER), MODEL, global_batch=32, seq_len=SEQ, top=3, baselines=False,
                  constraints=Constraints(tp_degrees=(1,), schedules=schedules))


def _estimator(result) -> Estimator:
    return Estimator(result.cluster, MODEL, result.cost, seq_len=SEQ, global_batch=32, memory_headroom=0.05)


def test_polish_finds_a_faster_split_one_layer_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """One round of polishing moves one layer between two stages of a leading plan (a split the
    estimate ties with the plan's, here from its T4 stage to its A100 stage), and the simulation is
    faster."""
    before = _search(0, monkeypatch)
    after = _search(1, monkeypatch)
    assert after.best.tokens_per_s > before.best.tokens_per_s * 1.002
    # The polished plan is one of the leaders with one layer moved (here the third: pp 2, 28 + 6).
    new = after.best.plan.layout

    def moved(layout) -> int:
        return sum(abs(a - b) for a, b in zip(layout.stage_layers, new.stage_layers, strict=True))

    origins = [p.plan.layout for p in before.plans
               if len(p.plan.layout.stage_layers) == len(new.stage_layers) and moved(p.plan.layout) == 2]
    assert origins  # one layer moved
    old = origins[0]
    assert [z.level for z in new.zero] == [z.level for z in old.zero]
    assert new.micro_batches == old.micro_batches
    # Only plans that improved join the ranking: the runners-up are the search's own.
    finalists = {p.candidate.key for p in before.simulated}
    assert [p.candidate.key for p in after.simulated if p.candidate.key not in finalists] == [
        after.best.candidate.key]


def test_tied_moves_keep_the_estimate_and_polished_plans_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _search(0, monkeypatch)
    est = _estimator(result)
    # The first plan with a tied neighbour.
    best = next(p for p in result.plans if list(tied_moves(est, p.candidate)))
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
    result = _search(0, monkeypatch, schedules=("1f1b", "interleaved"))
    interleaved = next(p for p in result.simulated if p.plan.layout.schedule == "interleaved")
    assert list(tied_moves(_estimator(result), interleaved.candidate)) == []


def _plan(tokens_per_s: float, cost: float | None = None) -> SimpleNamespace:
    """What ``objective_key`` reads of a ranked plan."""
    return SimpleNamespace(tokens_per_s=tokens_per_s, cost_per_mtoken=cost)


@pytest.mark.parametrize("objective", ["throughput", "cost"])
def test_close_runners_up_are_polished_on_one_budget(objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which plans polish_leaders polishes and keeps (polish itself, simulations included, is the
    tests above): the best and the runners-up within POLISH_WITHIN, best first, on one work
    budget; only what beats the best so far is kept. Under the cost objective smaller is better."""
    def plan(value: float) -> SimpleNamespace:  # cost 200 - value: 102 and 102.5 are within 3% of 100
        return _plan(value) if objective == "throughput" else _plan(0.0, 200.0 - value)

    ranked = [plan(100.0), plan(98.0), plan(97.5), plan(90.0)]  # 90 is more than 3% behind
    gains = {100.0: [plan(100.5)], 98.0: [plan(99.0), plan(101.0)], 97.5: [plan(102.0)]}
    calls: list[SimpleNamespace] = []
    budgets: set[int] = set()

    def fake_polish(start: SimpleNamespace, *args: object) -> list[SimpleNamespace]:
        calls.append(start)
        budgets.add(id(args[-1]))
        return gains[100.0 if start is ranked[0] else 98.0 if start is ranked[1] else 97.5]

    monkeypatch.setattr(polish_module, "polish", fake_polish)
    kept = polish_leaders(ranked, None, None, None, None, objective, set())
    assert calls == ranked[:3] and len(budgets) == 1
    assert kept == [gains[100.0][0], gains[98.0][1], gains[97.5][0]]  # 99.0 does not beat 100.5


def test_a_polished_runner_up_can_become_the_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 8 A100 and 8 T4, LLaMA-2-7B at 2 sequences per device (seq 2048), families that are
    polished and no TP: a runner-up of another structure, polished, ends faster than the best plan polished
    alone."""

    def best(starts: int):  # noqa: ANN202
        monkeypatch.setattr(polish_module, "POLISH_STARTS", starts)
        only = Constraints(tp_degrees=(1,), schedules=POLISHED)
        return search(parse_cluster_arg(CLUSTER), MODEL, global_batch=32, seq_len=SEQ,
                      top=3, baselines=False, constraints=only).best

    alone, leaders = best(1), best(3)
    assert leaders.tokens_per_s > alone.tokens_per_s
    assert leaders.candidate.structure != alone.candidate.structure  # another plan overtook
