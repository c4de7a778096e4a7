"""The reference search on tiny instances: never worse than the planner, exhaustive over the
splits x memory options of its seeds, and honest about its limits."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from medley.errors import MedleyInputError
from medley.search.estimate.bounds import memory_options
from medley.search.planner import search
from medley.search.report.reference_search import MAX_DEVICES, reference_search
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

TINY = get_model("tiny")


@pytest.mark.parametrize(
    ("cluster", "global_batch", "seq_len"),
    [("2xA100-80GB+2xV100-32GB", 16, 64), ("2xA100-80GB+2xT4-16GB", 32, 128)],
)
def test_reference_is_never_worse_than_the_planner(cluster: str, global_batch: int, seq_len: int) -> None:
    spec = parse_cluster_arg(cluster)
    planner = search(spec, TINY, global_batch=global_batch, seq_len=seq_len, top=1, baselines=False)
    reference = reference_search(spec, TINY, global_batch=global_batch, seq_len=seq_len, cost=planner.cost)
    assert reference.best is not None and reference.complete
    assert reference.best.tokens_per_s >= planner.best.tokens_per_s * (1 - 1e-9)
    assert reference.simulated > len(planner.simulated) and reference.enumerated >= 1
    fitting = [p.tokens_per_s for p in reference.plans.values() if p is not None]
    assert max(fitting) == reference.best.tokens_per_s


def test_reference_enumerates_every_split_and_option_of_a_small_seed() -> None:
    spec = parse_cluster_arg("2xA100-80GB+2xV100-32GB")
    planner = search(spec, TINY, global_batch=16, seq_len=64, top=1, baselines=False)
    reference = reference_search(spec, TINY, global_batch=16, seq_len=64, cost=planner.cost)
    best = reference.best
    assert best is not None
    layers, stages = TINY.num_layers, len(best.candidate.stage_layers)
    ladder = memory_options(best.plan.layout.dp)
    same_space = [
        key for key in reference.plans
        if key[0] == best.candidate.structure.assignment and key[3] == best.candidate.family
        and key[5] == best.candidate.micro_batches and key[2] == best.candidate.structure.micro_batch_size
    ]
    # Every split of the layers over the stages, under every memory option per stage.
    assert len(same_space) == math.comb(layers - 1, stages - 1) * len(ladder) ** stages


def test_reference_refuses_large_instances_and_stops_at_its_budget() -> None:
    big = parse_cluster_arg(f"{MAX_DEVICES}xA100-80GB+2xV100-32GB")
    with pytest.raises(MedleyInputError, match="at most 16"):
        reference_search(big, TINY, global_batch=16, seq_len=64, cost=search(
            parse_cluster_arg("2xA100-80GB"), TINY, global_batch=16, seq_len=64, top=1, baselines=False).cost)
    spec = parse_cluster_arg("2xA100-80GB+2xV100-32GB")
    planner = search(spec, TINY, global_batch=16, seq_len=64, top=1, baselines=False)
    stopped = reference_search(spec, TINY, global_batch=16, seq_len=64, cost=planner.cost, budget_s=0.0)
    assert not stopped.complete and stopped.enumerated == 0


def test_tp_moves_change_one_rank_onto_free_devices_of_its_node() -> None:
    from medley.search.report.reference_search import tp_moves
    from medley.search.rules.candidates import Estimator
    from medley.search.space import Constraints, Structure

    spec = parse_cluster_arg("4xA100-80GB")  # one node of 4
    planner = search(spec, TINY, global_batch=16, seq_len=64, top=1, baselines=False)
    est = Estimator(spec, TINY, planner.cost, seq_len=64, global_batch=16, memory_headroom=0.05)
    st = Structure(pool="all", strategy="stage-major", pp=2, dp=1, assignment=((0, 2),), micro_batch_size=1)
    seed = est.candidate(st, "1f1b")
    assert seed is not None
    moves = list(tp_moves(est, seed, [0, 1, 2, 3], Constraints()))
    # tiny's heads allow tp 2: rank 0 grows onto device 1, rank 1 onto device 3; nothing else fits.
    assert sorted(m.structure.tp for m in moves) == [(1, 2), (2, 1)]
    assert all(m.stage_layers == seed.stage_layers for m in moves)
    assert list(tp_moves(est, seed, [0, 1, 2, 3], Constraints(tp_degrees=(1,)))) == []
    crowded = Structure(pool="all", strategy="stage-major", pp=2, dp=1, assignment=((0, 1),),
                        micro_batch_size=1)
    seed = est.candidate(crowded, "1f1b")
    assert seed is not None
    # Rank 0 cannot grow onto rank 1's device; rank 1 grows onto device 2.
    assert [m.structure.tp for m in tp_moves(est, seed, [0, 1, 2, 3], Constraints())] == [(1, 2)]
    grown = replace(seed, structure=replace(crowded, tp=(1, 2)))
    assert [m.structure.tp for m in tp_moves(est, grown, [0, 1, 2, 3], Constraints())] == [()]
