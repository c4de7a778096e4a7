"""``medley launch PLAN --ssh`` against a fake ssh on this machine (it logs the host and runs the
remote line in bash, its stdin the session's): two nodes of 1 and 3 devices train equal to the
reference with each node's stderr named (its medley doctor report there too, stdout left to
the records); a rank's input error is shown once, named, exit 2; a
launcher stopped by SIGTERM leaves no agent or rank running on any node (the node's reader of
the closed session stops its agent); a node without host is one line before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_plans import cluster_file, node_toml, plan_file, tiny_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.launch.nodes import free_port
from medley.runtime.reference import reference_losses
from medley.runtime.train import TrainConfig

MEDLEY = str(Path(sys.executable).with_name("medley"))
TRAIN = ("--steps", "2", "--seed", "3", "--warmup-steps", "1", "--lr", "3e-3", "--min-lr", "3e-4",
         "--dtype", "fp32", "--device", "cpu")
FAKE_SSH = """#!/bin/bash
# ssh [-o OPTION]... HOST COMMAND: log the host, run COMMAND in bash here (stdin: the session's).
while [ "$1" = -o ]; do shift 2; done
echo "ssh $1" >> "$SSH_LOG"
shift
exec bash -c "$*"
"""


def _setup(tmp_path: Path, *, hosts: bool = True) -> tuple[Path, dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    host = "127.0.0.1" if hosts else None
    cluster = cluster_file(tmp_path, node_toml("one", 1, host=host), node_toml("three", 3, host=host))
    plan = plan_file(tmp_path, tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SSH_LOG": str(tmp_path / "ssh.log")}
    return plan, env


def _launch(plan: Path, *train: str) -> list[str]:
    return [MEDLEY, "launch", str(plan), "--ssh", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--", *train]


@pytest.mark.timeout(300)
def test_two_nodes_over_ssh_train_equal_to_the_reference(tmp_path: Path) -> None:
    plan, env = _setup(tmp_path)
    done = subprocess.run(_launch(plan, *TRAIN, "--json"), capture_output=True, text=True, env=env,
                          timeout=280)
    assert done.returncode == 0, done.stderr
    assert sorted((tmp_path / "ssh.log").read_text().split("\n")) == ["", "ssh 127.0.0.1", "ssh 127.0.0.1"]
    losses = [r["loss"] for r in json.loads(done.stdout)["records"]]
    want = reference_losses(tiny_plan(tmp_path / "cluster.toml", pp=2, dp=2, assignment=((3, 0), (1, 2)),
                                      split="2,2").layout,
                            TrainConfig.of(steps=2, seed=3, warmup_steps=1, lr=3e-3, min_lr=3e-4))
    assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) <= 1e-5
    shown = [line for line in done.stderr.splitlines() if line.strip()]
    assert all(line.startswith(("[one] ", "[three] ")) for line in shown), done.stderr


@pytest.mark.timeout(300)
def test_a_ranks_input_error_over_ssh_is_one_named_line(tmp_path: Path) -> None:
    plan, env = _setup(tmp_path)
    train = ("--steps", "1", "--device", "cpu", "--data", str(tmp_path / "none.txt"))
    done = subprocess.run(_launch(plan, *train), capture_output=True, text=True, env=env, timeout=280)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert all(line.startswith(("[one] ", "[three] ")) for line in lines), done.stderr
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].split("] ", 1)[1].startswith("error: --data "), done.stderr
    assert "none.txt" in errors[0] and not any("OMP_NUM_THREADS" in line for line in lines)


def _running(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.timeout(200)
def test_a_stopped_launcher_leaves_nothing_running_on_the_nodes(tmp_path: Path) -> None:
    plan, env = _setup(tmp_path)
    process = subprocess.Popen(_launch(plan, "--steps", "100000", "--device", "cpu"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env)
    marker, ranks = str(plan), f"medley.cli.main train --plan {plan}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_running(ranks)) < 4:  # four ranks started
            time.sleep(0.5)
        assert len(_running(ranks)) >= 4, "the ranks never started"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(marker):
        time.sleep(0.5)
    assert not _running(marker), "an agent or rank outlived the launcher"


def test_a_node_without_host_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, _ = _setup(tmp_path, hosts=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["launch", str(plan), "--ssh", "--rdzv-endpoint", "127.0.0.1:29400"])
    assert result.exit_code == 2
    assert result.output.strip() == ("error: --ssh: node one has no host in the cluster file; add host = "
                                     "\"NAME\" to its [[nodes]] entry, or run its command there yourself "
                                     "(--dry-run prints it)")
    assert not (tmp_path / "ssh.log").exists()
