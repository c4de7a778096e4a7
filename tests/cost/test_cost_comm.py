from pathlib import Path

import pytest

from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import Collective
from medley.spec.cluster_load import load_cluster, parse_cluster_arg

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GB = 1e9


def test_p2p_inside_and_across_nodes():
    comm = TopologyCommModel(load_cluster(EXAMPLES / "demo.toml"))
    assert comm.p2p_time(0, 0, 1e9) == 0
    assert comm.p2p_time(0, 1, 1e9) == pytest.approx(2e-6 + 1e9 / (300 * GB))  # A100 NVLink
    assert comm.p2p_time(0, 8, 1e9) == pytest.approx(50e-6 + 1e9 / (25 / 8 * GB))  # 25 GbE
    assert comm.path_links(0, 1) == ("dev:0:tx", "dev:1:rx")
    assert comm.path_links(0, 8) == ("dev:0:tx", "node:a100:nic:tx", "node:t4:nic:rx", "dev:8:rx")
    assert comm.link_bandwidth("node:a100:nic:tx") == pytest.approx(25 / 8 * GB)
    assert comm.link_bandwidth("dev:8:tx") == pytest.approx(16 * GB)


def test_ring_collectives_inside_one_node_follow_alpha_beta():
    comm = TopologyCommModel(parse_cluster_arg("8xA100-80GB"))
    group = tuple(range(8))
    rs = comm.collective_time(Collective.REDUCE_SCATTER, group, 8e9)
    assert rs == pytest.approx(7 * 2e-6 + 7 / 8 * 8e9 / (300 * GB))
    assert comm.collective_time(Collective.ALL_GATHER, group, 8e9) == pytest.approx(rs)
    assert comm.collective_time(Collective.ALL_REDUCE, group, 8e9) == pytest.approx(2 * rs)
    assert comm.collective_time(Collective.ALL_REDUCE, (3,), 8e9) == 0


def test_cross_node_groups_use_the_slow_tier_and_hierarchy_helps():
    comm = TopologyCommModel(parse_cluster_arg("8xA100-80GB+8xA100-80GB"))
    nbytes = 1e9
    group = tuple(range(16))
    ar = comm.collective_time(Collective.ALL_REDUCE, group, nbytes)
    flat = 2 * (15 * 10e-6 + 15 / 16 * nbytes / (12.5 * GB))
    hierarchical = 2 * (7 * 2e-6 + 7 / 8 * nbytes / (300 * GB) + 10e-6 + 0.5 * nbytes / (12.5 * GB))
    assert ar == pytest.approx(min(flat, hierarchical))
    assert ar < flat
    pair = comm.collective_time(Collective.ALL_REDUCE, (0, 8), nbytes)
    assert pair == pytest.approx(2 * (10e-6 + 0.5 * nbytes / (12.5 * GB)))


def test_large_cluster_groups_are_limited_by_the_slowest_tier_crossed():
    cluster = load_cluster(EXAMPLES / "large-1024.toml")
    comm = TopologyCommModel(cluster)
    rack = tuple(range(0, 64))  # one rack of H100 nodes
    zone = tuple(range(0, 512))  # H100 + A100 racks
    everything = tuple(range(1024))
    times = [comm.collective_time(Collective.ALL_REDUCE, g, 1e9) for g in (rack, zone, everything)]
    assert times[0] < times[1] < times[2]
    # The whole-cluster ring crosses the 25 Gb/s region tier: at least 2 x 1 GB at 3.125 GB/s per node.
    assert times[2] > 2 * (127 / 128) * 1e9 / (3.125 * GB)
