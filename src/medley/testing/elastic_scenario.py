"""Elastic runs of ``medley launch --elastic --local`` on three emulated one-device nodes, for the
elastic tests and ``bench/elastic.py``: start them, kill a node's agent at a step, bring it back,
read what they logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medley.launch import elastic_dir
from medley.launch.nodes import free_port

MEDLEY = (sys.executable, "-m", "medley.cli.main")
STEPS, EVERY = 20, 5
# Every device computes 30x slower than this CPU can (sleeps): a step takes long enough to kill at.
SLOW = "0=30,1=30,2=30"
# One network tier joining the nodes (the launch tests' cluster files use it too).
TIERS = '[[tiers]]\nname = "net"\nbandwidth_gbps = 10\n'


def three_nodes(directory: Path, *, memory_gb: float | None = None) -> Path:
    memory = "" if memory_gb is None else f"memory_gb = {memory_gb}\n"
    nodes = "".join(f'[[nodes]]\nname = "{n}"\ndevice = "CPU-8GB"\ncount = 1\n{memory}' for n in "abc")
    path = directory / "cluster.toml"
    path.write_text('name = "three"\n' + nodes + TIERS)
    return path


def token_file(directory: Path) -> Path:
    """Random token ids of the tiny model's vocabulary: windows with indices to check."""
    path = directory / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, size=33 * 400, dtype=np.uint16).tofile(path)
    return path


def make_plan(directory: Path, cluster: Path) -> Path:
    out = directory / "plan.toml"
    subprocess.run([*MEDLEY, "plan", "--cluster", str(cluster), "--model", "tiny", "--global-batch", "12",
                    "--seq-len", "32", "--out", str(out), "--no-baselines"], check=True, capture_output=True)
    return out


TRAIN = {"steps": STEPS, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "weight_decay": 0.1, "clip_norm": 1.0,
         "dtype": "fp32", "seed": 0}


def train_flags(directory: Path, data: Path, *extra: str) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TRAIN.items()]
    return [*flags, "--data", str(data), "--checkpoint-dir", str(directory / "ckpt"), "--checkpoint-every",
            str(EVERY), "--log-jsonl", str(directory / "log.jsonl"), *extra]


@dataclass
class Run:
    """A running ``medley launch --elastic --local`` and where it writes."""

    process: subprocess.Popen[str]
    directory: Path
    endpoint: str
    rdzv_id: str

    @property
    def elastic(self) -> Path:
        return self.directory / "ckpt" / "elastic"

    out: str = ""

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        """Wait for the launcher: (exit status, its stderr); its stdout is kept as ``out``."""
        self.out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, err


def launch(directory: Path, plan: Path, flags: list[str], *, node: str | None = None,
           endpoint: str | None = None, rdzv_id: str = "elastic-test") -> Run:
    endpoint = endpoint or f"127.0.0.1:{free_port()}"
    only = [] if node is None else ["--node", node]
    argv = [*MEDLEY, "launch", str(plan), "--elastic", "--local", "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id, *only, "--", *flags]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=directory, start_new_session=True)
    return Run(process=process, directory=directory, endpoint=endpoint, rdzv_id=rdzv_id)


def heartbeat_step(run: Run) -> int:
    try:
        return int(json.loads((run.elastic / "heartbeat.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def wait_for(condition, *, timeout: float = 180, what: str, run: Run | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or (run is not None and run.process.poll() is not None):
            said = ""
            if run is not None:
                if run.process.poll() is None:
                    os.killpg(run.process.pid, signal.SIGTERM)
                said = run.process.communicate(timeout=60)[1][-3000:]
            raise AssertionError(f"timed out waiting for {what}: {said}")
        time.sleep(0.05)


def agent_of(run: Run, node: str) -> int:
    """The pid of ``node``'s agent among the launcher's children (its MEDLEY_NODE)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == run.process.pid and f"MEDLEY_NODE={node}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no agent of node {node} under the launcher")


def kill_node_at(run: Run, node: str, step: int) -> float:
    """``kill -9`` of ``node``'s agent once ``step`` steps are done (during step ``step``); when."""
    wait_for(lambda: heartbeat_step(run) >= step, what=f"step {step}", run=run)
    pid = agent_of(run, node)
    os.kill(pid, signal.SIGKILL)
    return time.time()


def events(run: Run) -> list[dict]:
    return elastic_dir.events(run.elastic)


def final_records(directory: Path) -> dict[int, dict]:
    """The last record of each step in the run's log (a redone step's second record wins)."""
    out: dict[int, dict] = {}
    for line in (directory / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "loss" in record:
            out[record["step"]] = record
    return out
