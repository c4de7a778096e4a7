"""The planner's analytic estimate books its links as the simulator does: collectives that share
a node's network port queue behind each other, a pipeline hop across a slow tier holds the node's
port for as long as it takes on that tier, and 1F1B's in-flight limit makes a slow boundary
stretch every cycle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Collective
from medley.cost.zero_memory import state_bytes_per_param
from medley.lowering.collectives import OPTIMIZER_STEP_BYTES_PER_PARAM
from medley.search.estimate.bounds import pipeline_time, round_trip_cycle
from medley.search.estimate.step_estimate import exposed_dp, network_load
from medley.search.rules.candidates import Estimator
from medley.search.space import Structure, memory_option
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model_arg import get_model

MODEL = get_model("llama-2-7b")


def _estimator(region_gbit: float = 200.0) -> Estimator:
    """Two nodes of 8 H100s; the rack tier (200 Gbit/s) joins a node to nothing else, so traffic
    between the nodes crosses the region tier."""
    raw = {
        "name": "two-nodes",
        "nodes": [{"name": "a", "device": "H100-SXM-80GB", "count": 8},
                  {"name": "b", "device": "H100-SXM-80GB", "count": 8}],
        "tiers": [
            {"name": "rack", "bandwidth_gbit": 200, "latency_us": 5, "groups": {"ra": ["a"], "rb": ["b"]}},
            {"name": "region", "bandwidth_gbit": region_gbit, "latency_us": 1000},
        ],
    }
    cluster = cluster_from_dict(raw, source="test")
    cost = CatalogCostSource.for_cluster(MODEL, cluster)
    return Estimator(cluster, MODEL, cost, seq_len=4096, global_batch=32, memory_headroom=0.05)


def _structure(assignment: tuple[tuple[int, ...], ...]) -> Structure:
    return Structure(pool="all", strategy="stage-major", pp=len(assignment[0]), dp=len(assignment),
                     assignment=assignment, micro_batch_size=1)


def test_dp_collectives_sharing_a_node_port_queue() -> None:
    """Both pipeline ranks' DP groups span nodes a and b, so their reductions share both nodes'
    network ports: with no tail bubble to hide in, the exposed time is both reductions, both
    weight gathers and the larger optimizer step, not the larger stage's alone."""
    est = _estimator()
    st = _structure(((0, 1), (8, 9)))
    split = (17, 17)
    level1 = memory_option(1)
    exposed = exposed_dp(est, st, split, (level1, level1), (16, 16), 0.0)
    state = state_bytes_per_param(est.dtype(st.assignment))
    reductions, gathers, steps = 0.0, 0.0, []
    for rank, (start, stop) in enumerate(((0, 17), (17, 34))):
        params = float(formulas.stage_held_params(MODEL, start, stop))
        group = (rank, 8 + rank)
        reductions += est.comm.collective_time(Collective.REDUCE_SCATTER, group, params * state.grads)
        gathers += est.comm.collective_time(Collective.ALL_GATHER, group, params * state.weights)
        bandwidth = est.cluster.devices[0].type.memory_bandwidth_gbps * 1e9
        steps.append(params / 2 * OPTIMIZER_STEP_BYTES_PER_PARAM / bandwidth)
    assert exposed == pytest.approx(reductions + gathers + max(steps), rel=1e-12)
    alone = exposed_dp(est, _structure(((0, 1),)), split, (level1, level1), (32,), 0.0)
    assert alone < exposed / 2  # one replica: no DP collectives, the optimizer steps only


def test_a_tail_bubble_hides_the_later_ranks_reduction() -> None:
    """Rank 1 finishes its backward half a stage time before rank 0: its reduction starts then."""
    est = _estimator()
    st = _structure(((0, 1), (8, 9)))
    options = (memory_option(1), memory_option(1))
    tight = exposed_dp(est, st, (17, 17), options, (16, 16), 0.0)
    hidden = exposed_dp(est, st, (17, 17), options, (16, 16), 1e3)
    rank1 = est.comm.collective_time(
        Collective.REDUCE_SCATTER, (1, 9),
        float(formulas.stage_held_params(MODEL, 17, 34)) * state_bytes_per_param("bf16").grads)
    assert hidden == pytest.approx(tight - rank1, rel=1e-9)


@pytest.mark.parametrize("region_gbit", [200.0, 25.0])
def test_a_hop_holds_the_node_port_for_its_time_on_the_path(region_gbit: float) -> None:
    """One replica, two stages on two nodes: each node's port carries one activation (or its
    gradient) per micro-batch for the hop's time on the region tier, however slow that is."""
    est = _estimator(region_gbit)
    nbytes = formulas.boundary_bytes(MODEL, micro_batch_size=1, seq_len=4096)
    load = network_load(est, _structure(((0, 8),)))
    assert load == pytest.approx(est.comm.p2p_time(0, 8, nbytes), rel=1e-12)
    if region_gbit < 200.0:
        assert load > 7 * nbytes / est.comm.link_bandwidth("node:a:nic:tx")


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=12))
def test_without_transfers_the_round_trip_never_exceeds_the_slowest_stage(times: list[float]) -> None:
    """Rank k's loop holds pp-k micro-batches and pp-k stages' compute: their mean, at most the
    slowest; so without transfers 1F1B's estimate is unchanged."""
    m = 8
    cycle = round_trip_cycle(times, [0.0] * (len(times) - 1), m)
    assert cycle <= max(times) * (1 + 1e-12)
    assert round_trip_cycle(times, [], m) == cycle  # no link times given: none
    assert pipeline_time("1f1b", stage_times=times, stage_weight_times=[0.0] * len(times),
                         link_times=[], micro_batches=m) == pytest.approx(
        (m - 1) * max(times) + sum(times), rel=1e-12)


def test_a_slow_last_boundary_stretches_every_cycle() -> None:
    """Two equal stages of s seconds joined by a transfer of t: stage 0 keeps two micro-batches
    in flight, each going s + 2t + s round the loop, so a cycle takes s + t, not max(s, t)."""
    s, t = 1.0, 0.4
    assert round_trip_cycle([s, s], [t], 10) == pytest.approx(s + t)
    assert round_trip_cycle([s, s], [t], 2) == s  # stage 0 holds both micro-batches from the start
    kw = {"stage_times": [s, s], "stage_weight_times": [0.0, 0.0], "link_times": [t], "micro_batches": 10}
    assert pipeline_time("1f1b", **kw) == pytest.approx(9 * (s + t) + 2 * s + 2 * t)
    # gpipe, hetero-1f1b (deeper warm-up before slow links) and interleaved keep their rules
    assert pipeline_time("gpipe", **kw) == pytest.approx(9 * s + 2 * s + 2 * t)
    assert pipeline_time("hetero-1f1b", **kw) == pytest.approx(9 * s + 2 * s + 2 * t)
    interleaved = pipeline_time("interleaved", **kw, virtual_stages=2)
    assert interleaved == pytest.approx(9 * s + (2 * s + 2 * t) / 2 + 2 * t)
