"""The device orders the planner assigns pipeline ranks from (the strategies of
``Estimator.structures``): on a pool of several types the slowest devices may come first, so that
the fast ones, which take the most layers, sit on the last ranks (fewest micro-batches in flight)."""

from __future__ import annotations

from medley.cost.estimator import CatalogCostSource
from medley.search.estimate.structure_bound import structure_bound
from medley.search.planner import search
from medley.search.rules.candidates import Estimator
from medley.search.space import Structure
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

MODEL = get_model("llama-2-7b")


def test_mixed_pools_get_a_slowest_first_order_and_single_types_do_not() -> None:
    cluster = parse_cluster_arg("8xH100-SXM-80GB+8xA100-80GB")
    est = Estimator(cluster, MODEL, CatalogCostSource.for_cluster(MODEL, cluster), seq_len=4096,
                    global_batch=32, memory_headroom=0.05)
    pools = {"all": list(range(16)), "H100-SXM-80GB": list(range(8))}
    found = {(st.pool, st.strategy): st for st in est.structures(pools, max_pp=4, micro_batch_sizes=(1,))
             if st.pp == 2 and not st.tp}
    slowest = found[("all", "slowest-first")]
    first, last = ({cluster.devices[row[k]].type.name for row in slowest.assignment} for k in (0, -1))
    assert first == {"A100-80GB"} and last == {"H100-SXM-80GB"}
    assert ("H100-SXM-80GB", "slowest-first") not in found


def test_the_fast_devices_last_win_on_h100_and_a100() -> None:
    """LLaMA-2-7B on 8 H100 + 8 A100 at 2 sequences per device of 2,048 tokens: the best plan runs
    the A100s first, and it beats every simulated plan of another order. (With the catalog
    calibrated on published runs, bench/published_fit.py, the H100's lead over the A100 is smaller
    than its peak says, and so is this gain: 0.95%, where it was over 2%.)"""
    result = search(parse_cluster_arg("8xH100-SXM-80GB+8xA100-80GB"), MODEL, global_batch=32, seq_len=2048,
                    top=1, baselines=False)
    best = result.best
    assert best.candidate.structure.strategy == "slowest-first"
    others = [p.tokens_per_s for p in result.simulated
              if p.fits and not p.plan.asymmetric and p.candidate.structure.strategy != "slowest-first"]
    assert others and best.tokens_per_s > 1.005 * max(others)


def _estimator(cluster_arg: str, model_name: str, global_batch: int) -> tuple[Estimator, object]:
    cluster, model = parse_cluster_arg(cluster_arg), get_model(model_name)
    est = Estimator(cluster, model, CatalogCostSource.for_cluster(model, cluster), seq_len=4096,
                    global_batch=global_batch, memory_headroom=0.05)
    return est, cluster


def test_slowest_first_uses_the_fastest_devices_and_more_than_one_rank() -> None:
    """When the global batch leaves devices over, slowest-first takes the same devices as
    stage-major (the fastest), only ordered slowest first; one-rank replicas get no such order."""
    est, cluster = _estimator("8xH100-SXM-80GB+8xA100-80GB", "llama-2-7b", 12)
    structures = list(est.structures({"all": list(range(16))}, max_pp=8, micro_batch_sizes=(1, 2)))
    def shape(st: Structure) -> tuple:
        return st.pp, st.dp, st.micro_batch_size, st.tp

    def used(st: Structure) -> set[int]:
        return {d for row in st.assignment for d in row}

    twins = {shape(st): st for st in structures if st.strategy == "stage-major"}
    slowest = [st for st in structures if st.strategy == "slowest-first"]
    assert slowest and all(st.pp > 1 for st in slowest)
    assert all(used(st) == used(twins[shape(st)]) for st in slowest)
    partial = [st for st in slowest if st.pp * st.dp < 16 and not st.tp]
    assert partial  # e.g. pp 3 x dp 4 on 12 of 16 devices: the 8 H100 and 4 A100
    assert all(cluster.devices[st.assignment[0][0]].type.name == "A100-80GB" for st in partial)


def test_the_structure_bound_stays_below_the_estimate_whatever_the_order() -> None:
    """The search skips structures by a bound judged on memory; on H100 + V100 the fast devices
    last (most layers, least room on the V100 first) must not raise it above the estimate."""
    est, _ = _estimator("8xH100-SXM-80GB+8xV100-32GB", "llama-2-7b", 32)
    checked = 0
    for st in est.structures({"all": list(range(16))}, max_pp=8, micro_batch_sizes=(1,)):
        candidate = est.candidate(st, "1f1b")
        if candidate is not None:
            assert structure_bound(est, st) <= candidate.estimate_s * (1 + 1e-9), st
            checked += st.strategy == "slowest-first"
    assert checked
