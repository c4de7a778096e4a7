"""The α-β fit recovers known latency and bandwidth, on the formulas the simulator uses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import Collective
from medley.cost.profile_format import AlphaBeta, CommMeasurement
from medley.profile.comm_bench import OPS, fit_alpha_beta, model_time
from medley.spec.cluster_load import parse_cluster_arg

SIZES = (4e3, 3.2e4, 2.6e5, 2e6, 8e6)


def _synthetic(alpha: float, beta: float, noise: float = 0.0) -> list[CommMeasurement]:
    truth = AlphaBeta(latency_s=alpha, bandwidth_bytes_per_s=beta, median_rel_error=0.0)
    rows = []
    for i, (op, ranks, nbytes) in enumerate((op, r, n) for op in OPS for r in (2, 4) for n in SIZES):
        wiggle = 1.0 + noise * (1 if i % 2 else -1)
        rows.append(CommMeasurement(op=op, ranks=ranks, nbytes=nbytes,
                                    seconds=model_time(op, ranks, nbytes, truth) * wiggle))
    return rows


@settings(max_examples=25, deadline=None)
@given(alpha=st.floats(1e-6, 1e-3), beta=st.floats(1e8, 1e11))
def test_exact_data_gives_the_parameters_back(alpha: float, beta: float) -> None:
    fit = fit_alpha_beta(_synthetic(alpha, beta))
    assert fit.latency_s == pytest.approx(alpha, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(beta, rel=1e-6)
    assert fit.median_rel_error < 1e-9


def test_noisy_data_stays_close() -> None:
    fit = fit_alpha_beta(_synthetic(2e-4, 1.5e9, noise=0.05))
    assert fit.latency_s == pytest.approx(2e-4, rel=0.1)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1.5e9, rel=0.1)
    assert fit.median_rel_error == pytest.approx(0.05, rel=0.2)


def test_fit_matches_the_simulators_comm_model() -> None:
    """A fitted link put into a one-node cluster times all-reduce as the model formula does."""
    fit = AlphaBeta(latency_s=1e-4, bandwidth_bytes_per_s=2e9, median_rel_error=0.0)
    cluster = parse_cluster_arg("4xCPU")
    node = cluster.nodes[0]
    object.__setattr__(node.link, "bandwidth_gbps", 2.0)
    object.__setattr__(node.link, "latency_us", 100.0)
    comm = TopologyCommModel(cluster)
    for op, collective in (("all_reduce", Collective.ALL_REDUCE), ("all_gather", Collective.ALL_GATHER)):
        want = model_time(op, 4, 1e6, fit)
        assert comm.collective_time(collective, (0, 1, 2, 3), 1e6) == pytest.approx(want)
    assert comm.p2p_time(0, 1, 1e6) == pytest.approx(model_time("send_recv", 2, 1e6, fit))
