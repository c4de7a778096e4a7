"""The device orders the planner assigns pipeline ranks from (the strategies of
``Estimator.structures``): on a pool of several types the slowest devices may come first, so that
the fast ones, which take the most layers, sit on the last ranks (fewest micro-batches in flight)."""

from __future__ import annotations

from medley.cost.estimator import CatalogCostSource
from medley.plan.candidates import Estimator
from medley.plan.search import search
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
    """LLaMA-2-7B on 8 H100 + 8 A100 at 2 sequences per device: the best plan runs the A100s
    first, and it beats every simulated plan of another order."""
    result = search(parse_cluster_arg("8xH100-SXM-80GB+8xA100-80GB"), MODEL, global_batch=32, seq_len=4096,
                    top=1, baselines=False)
    best = result.best
    assert best.candidate.structure.strategy == "slowest-first"
    others = [p.tokens_per_s for p in result.simulated
              if p.fits and p.candidate.structure.strategy != "slowest-first"]
    assert others and best.tokens_per_s > 1.02 * max(others)
