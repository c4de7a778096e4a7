"""Issue #12, item 4: `medley profile --comm` under torchrun measures each network tier, and
plan/simulate/show use those links instead of the cluster file's nominal ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.comm_profile import apply_comm_profile, load_comm_profile
from medley.launch.nodes import free_port
from medley.spec.cluster_load import parse_cluster_arg

BIN = Path(sys.executable).parent
CLUSTER = "2xA100-80GB+2xV100-32GB"  # nodes node0 (A100s) and node1 (V100s)


def _torchrun_two_nodes(out: Path) -> None:
    """Two torchrun agents on this machine, two ranks each, playing the cluster's node0 and node1
    (subprocess = fork+exec: no torch state is forked)."""
    port = free_port()
    agents = []
    for node in (0, 1):
        env = {**os.environ, "MEDLEY_NODE": f"node{node}", "OMP_NUM_THREADS": "1"}
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "comm",
               str(BIN / "medley"), "profile", "--comm", "--comm-sizes", "4096,262144", "--runs", "3",
               "--out", str(out)]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    outputs = [a.communicate(timeout=180)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), outputs


def _simulate(*extra: str) -> dict:
    args = ["simulate", "--cluster", CLUSTER, "--model", "tiny", "--pp", "2", "--dp", "2", "--seq-len", "64"]
    result = CliRunner().invoke(app, [*args, "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_comm_profile_per_tier_under_torchrun_replaces_the_nominal_links(tmp_path: Path) -> None:
    path = tmp_path / "comm.json"
    _torchrun_two_nodes(path)
    profile = load_comm_profile(path)
    assert profile.backend == "gloo" and profile.ranks_per_node == {"node0": 2, "node1": 2}
    tiers = sorted((link.tier, tuple(sorted(link.nodes))) for link in profile.links)
    want = [("inter-node", ("node0", "node1")), ("intra-node", ("node0",)), ("intra-node", ("node1",))]
    assert tiers == want
    nominal = parse_cluster_arg(CLUSTER)
    measured = apply_comm_profile(nominal, profile, path=path)
    inter = next(link for link in profile.links if link.tier == "inter-node")
    assert measured.tiers[0].bandwidth_gbps == inter.fit.bandwidth_bytes_per_s / 1e9
    assert measured.tiers[0].latency_us == inter.fit.latency_s * 1e6
    for node in measured.nodes:
        fit = next(link.fit for link in profile.links if link.nodes == [node.name])
        assert node.link.latency_us == fit.latency_s * 1e6
    # gloo on one CPU is far slower than the nominal NVLink/network: the step takes longer.
    assert _simulate("--comm-profile", str(path))["step_time_s"] > _simulate()["step_time_s"]


def test_a_comm_profile_of_other_nodes_is_refused(tmp_path: Path) -> None:
    fit = {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9, "median_rel_error": 0.0}
    row = {"op": "all_reduce", "ranks": 2, "nbytes": 4096.0, "seconds": 2e-4}
    data = {"format": "medley-comm-profile", "version": 1, "created": "2026-01-01", "backend": "gloo",
            "world_size": 2, "ranks_per_node": {"gpu-host-7": 2},
            "links": [{"tier": "intra-node", "nodes": ["gpu-host-7"], "ranks": 2, "fit": fit,
                       "measurements": [row]}]}
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["simulate", "--cluster", CLUSTER, "--model", "tiny", "--comm-profile",
                                      str(path)])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "measured node 'gpu-host-7'" in line and "nodes: node0, node1" in line
