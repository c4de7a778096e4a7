"""The bound the search orders and skips structures by (:mod:`medley.search.estimate.structure_bound`): below
every structure's 1F1B estimate, infinite only where nothing fits, and equal to its closed forms."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from medley.cost.estimator import CatalogCostSource
from medley.search.estimate.structure_bound import StructureBounds, block_bound, fill_bound, recompute_bound
from medley.search.planner import search
from medley.search.rules.candidates import Estimator
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

CASES = [
    ("8xH100-SXM-80GB+8xV100-32GB", "llama-2-7b", 32),
    ("8xH100-SXM-80GB+8xA100-80GB", "llama-2-13b", 32),
    ("8xA100-80GB+8xH100-SXM-80GB", "llama-2-70b", 32),  # 70B fits only as pp2 x tp8, recomputing
    ("8xH100-SXM-80GB+4xA100-80GB+4xL4-24GB", "llama-2-13b", 64),
]


@pytest.mark.parametrize(("cluster_arg", "model_name", "global_batch"), CASES)
def test_the_bound_is_below_every_estimate_and_infinite_only_where_nothing_fits(
    cluster_arg: str, model_name: str, global_batch: int
) -> None:
    cluster, model = parse_cluster_arg(cluster_arg), get_model(model_name)
    est = Estimator(cluster, model, CatalogCostSource.for_cluster(model, cluster), seq_len=4096,
                    global_batch=global_batch, memory_headroom=0.0)
    by_type: dict[str, list[int]] = {}
    for d, device in enumerate(cluster.devices):
        by_type.setdefault(device.type.name, []).append(d)
    pools = {"all": list(range(cluster.num_devices)), **by_type}
    bound = StructureBounds(est)
    fits = infinite = 0
    for st in est.structures(pools, max_pp=model.num_layers, micro_batch_sizes=(1, 2)):
        candidate = est.candidate(st, "1f1b")
        b, refined = bound(st), bound.refined(st)
        assert refined >= b
        if candidate is None:
            infinite += b == float("inf")
            continue
        fits += 1
        assert refined <= candidate.estimate_s * (1 + 1e-9), st
    assert fits
    if model_name == "llama-2-70b":
        assert infinite  # most structures cannot hold 70B; the bound says so without a build


def test_llama_70b_on_16_devices_finds_its_plan() -> None:
    """The only fitting structure (A100 then H100 stages, tp8, recomputing) was skipped as unable to
    hold its model state, by a check that counted more state bytes than any option books."""
    result = search(parse_cluster_arg("8xH100-SXM-80GB+8xA100-80GB"), get_model("llama-2-70b"),
                    global_batch=32, seq_len=4096, top=1, baselines=False)
    assert result.best.fits and result.best.candidate.structure.tp


def _rank(seconds: float, *, recomputing: float | None = None, plain: float = 1.0, most: float = 1.0,
          blocks: int = 10):
    """A rank of a model of ``blocks`` alike blocks and nothing else, holding ``plain`` of it
    without recomputation and ``most`` with."""
    recomputing = recomputing if recomputing is not None else seconds * 4 / 3
    return (seconds, recomputing, plain, most, seconds / blocks, recomputing / blocks, int(plain * blocks),
            int(most * blocks))


@given(hs.floats(0.01, 10.0), hs.integers(1, 16), hs.integers(1, 8), hs.integers(1, 64))
def test_alike_ranks_bound_at_1f1b_with_its_fill(seconds: float, pp: int, dp: int, per_replica: int) -> None:
    """pp x dp alike ranks, m micro-batches each: (m + pp - 1) x seconds / pp, both bounds."""
    rows = Counter({(_rank(seconds),) * pp: dp})
    expected = (per_replica + pp - 1) * seconds / pp
    assert fill_bound(rows, per_replica * dp) == pytest.approx(expected, rel=1e-9)
    assert recompute_bound(rows, per_replica * dp) == pytest.approx(expected, rel=1e-9)


@settings(max_examples=200)
@given(hs.lists(hs.floats(0.01, 10.0), min_size=1, max_size=6), hs.integers(1, 40))
def test_one_replica_bound_is_the_best_set_of_fastest_ranks(times: list[float], m: int) -> None:
    """The least over j of (m + j - 1) / (the j fastest ranks' summed speed)."""
    ordered = sorted(times)
    speeds = [sum(1.0 / t for t in ordered[:j]) for j in range(1, len(ordered) + 1)]
    expected = min((m + j) / s for j, s in enumerate(speeds))
    assert fill_bound(Counter({tuple(_rank(t) for t in times): 1}), m) == pytest.approx(expected, rel=1e-9)


def test_memory_limits_raise_the_bound_and_too_little_memory_makes_it_infinite() -> None:
    roomy = (_rank(1.0),) * 4
    tight = (_rank(1.0, recomputing=1.5, plain=0.1, most=0.3),) * 4
    full = (_rank(1.0, plain=0.1, most=0.2),) * 4  # 4 x 0.2 < the whole model
    assert recompute_bound(Counter({roomy: 1}), 16) == pytest.approx(19 / 4)
    # Each rank holds 1/4: 0.1 plain at 1 s per model, 0.15 recomputing at 1.5: B = 0.325.
    assert recompute_bound(Counter({tight: 1}), 16) == pytest.approx(15 * 0.325 + 4 * 0.325)
    assert recompute_bound(Counter({full: 1}), 16) == float("inf")


def test_whole_blocks_raise_the_bottleneck() -> None:
    """10 blocks of 1 s on 4 alike ranks: 2.5 s by fractions, 3 s by whole blocks (3 + 3 + 2 + 2);
    the least sum of stage times stays the whole model's 10 s."""
    rows = Counter({(_rank(10.0),) * 4: 1})
    assert recompute_bound(rows, 16) == pytest.approx(15 * 2.5 + 10)
    assert block_bound(rows, 16, 10) == pytest.approx(15 * 3 + 10)
    # Plain stages hold 2 blocks at most, recomputing ones (4/3 s a block) all; a stage may
    # recompute only the blocks beyond its plain two: 3 blocks take 2 + 4/3 s.
    # The least sum: 0.8 of the model plain (8 s), the rest recomputing (0.2 x 40/3 s).
    tight = Counter({(_rank(10.0, plain=0.2),) * 4: 1})
    assert block_bound(tight, 16, 10) == pytest.approx(15 * (2 + 4 / 3) + 8 + 0.2 * 40 / 3)
    assert block_bound(Counter({(_rank(10.0, plain=0.2, most=0.2),) * 4: 1}), 16, 10) == float("inf")
