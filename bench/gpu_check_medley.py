"""The GPU check's calls of medley, each through its command line in a fresh interpreter (so a
change of medley's internals cannot break the check, and a crash or an out-of-memory stops only
that step): plan, show (the simulator's prediction of a plan file), profile, train, the refusal
of a plan with more ranks than GPUs, and the interleaved case against one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
CLI = "import sys; from medley.cli.main import app; sys.argv[0] = 'medley'; app()"


@dataclass
class Done:
    args: list[str]
    rc: int
    stdout: str
    stderr: str
    started: float  # time.time()
    seconds: float

    def tail(self, lines: int = 6) -> str:
        return " | ".join((self.stderr or self.stdout).strip().splitlines()[-lines:])


class MedleyFailed(RuntimeError):
    pass


def spawn(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Done:
    """Run ``cmd`` (a fresh interpreter) with medley's src/ first on PYTHONPATH, in its own process
    group, all of which is killed at ``timeout`` (a train's ranks too, so none keeps the GPU)."""
    full_env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p),
    }
    started, clock = time.time(), time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise MedleyFailed(
            f"stopped at its {timeout:.0f} s time box; stderr: "
            + " | ".join(stderr.strip().splitlines()[-4:])
        ) from None
    return Done(cmd, proc.returncode, stdout, stderr, started, time.monotonic() - clock)


def medley(args: list[str], *, timeout: float, env: dict[str, str] | None = None, check: bool = True) -> Done:
    """``medley ARGS`` with this Python (:func:`spawn`); MedleyFailed on a non-zero exit if ``check``."""
    try:
        done = spawn([sys.executable, "-c", CLI, *args], timeout=timeout, env=env)
    except MedleyFailed as err:
        raise MedleyFailed(f"medley {args[0]} {err}") from None
    if check and done.rc != 0:
        raise MedleyFailed(f"medley {args[0]} exit {done.rc}: {done.tail()}")
    return done


def help_flags(command: str, *, timeout: float) -> set[str]:
    """The --flags ``medley COMMAND --help`` lists (the check adapts to what this medley has)."""
    text = medley([command, "--help"], timeout=timeout, env={"COLUMNS": "200"}).stdout
    return {word.strip(",").split("=")[0] for word in text.split() if word.startswith("--")}


def plan(model: str, *, cluster: str, global_batch: int, seq_len: int, out: Path, timeout: float) -> dict:
    """``medley plan`` for the catalog: the best plan's layout and prediction, written to ``out``."""
    data = json.loads(
        medley(
            [
                "plan",
                "--cluster",
                cluster,
                "--model",
                model,
                "--global-batch",
                str(global_batch),
                "--seq-len",
                str(seq_len),
                "--top",
                "1",
                "--no-baselines",
                "--out",
                str(out),
                "--json",
            ],
            timeout=timeout,
        ).stdout
    )
    best = data["plans"][0]
    layout = tomllib.loads(out.read_text())["layout"]
    keys = (
        "pp",
        "dp",
        "tp",
        "schedule",
        "micro_batches",
        "micro_batch_size",
        "zero",
        "recompute",
        "recompute_mode",
        "split",
        "dtype",
        "step_time_s",
        "mfu",
    )
    return {
        "file": out.name,
        "cluster": cluster,
        **{k: best.get(k) for k in keys},
        "micro_batch_size": layout["micro_batch_size"],
        "seq_len": layout["seq_len"],
    }


def show(plan_file: Path, *, profile: Path | None, timeout: float) -> dict:
    """The simulator's prediction of a plan file: the catalog's, or with a measured profile."""
    args = ["show", str(plan_file), "--no-baselines", "--json"]
    if profile is not None:
        args += ["--profile", str(profile)]
    data = json.loads(medley(args, timeout=timeout).stdout)
    return {
        "source": "profile" if profile else "catalog",
        "cost_source": data.get("cost_source"),
        "step_time_s": data["step_time_s"],
        "tokens_per_s": data.get("tokens_per_s"),
        "mfu": data.get("mfu"),
        "fits": data.get("fits"),
        "peak_memory_bytes": {str(d["device"]): d["peak_memory_gb"] * 1e9 for d in data["devices"]},
    }


def profile(
    model: str,
    *,
    device: str,
    device_type: str,
    micro_batch_size: int,
    seq_len: int,
    runs: int,
    out: Path,
    compile: bool = False,
    timeout: float,
) -> dict:
    args = [
        "profile",
        "--model",
        model,
        "--device",
        device,
        "--device-type",
        device_type,
        "--dtype",
        "bf16",
        "--micro-batch-sizes",
        str(micro_batch_size),
        "--seq-len",
        str(seq_len),
        "--runs",
        str(runs),
        "--comm-ranks",
        "0",
        "--no-overhead",
        "--out",
        str(out),
        "--json",
    ]
    data = json.loads(medley(args + (["--compile"] if compile else []), timeout=timeout).stdout)
    figures = ("kind", "micro_batch_size", "seq_len", "forward_s", "backward_full_s")
    return {
        "file": out.name,
        "device_type": data.get("device_type"),
        "detail": data.get("device_detail"),
        "layers": [{k: layer.get(k) for k in figures} for layer in data.get("layers", [])],
    }


def train(
    args: list[str],
    *,
    steps: int,
    tokens_per_step: int,
    flops_per_step: float,
    peak_flops: float,
    flags: set[str],
    dry: bool,
    compile: bool = False,
    env: dict[str, str] | None = None,
    timeout: float,
) -> dict:
    """``medley train ARGS`` on this machine's ranks with synthetic data; the mean step time of the
    steps after the first two, tokens/s and MFU by the plain loop's formula (Megatron's FLOPs over
    the catalog peak), the peak memory per device and the seconds outside the steps (start-up,
    initialisation, teardown)."""
    extra = ["--steps", str(steps), "--data", "synthetic", "--warmup-steps", "1", "--lr", "3e-4", "--json"]
    if "--log-every" in flags:
        extra += ["--log-every", "1"]  # a record per step: their times are what is compared
    if dry and "--device" in flags:
        extra += ["--device", "cpu"]
    if compile:
        extra.append("--compile")
    done = medley(["train", *args, *extra], timeout=timeout, env=env)
    records = json.loads(done.stdout)["records"]
    timed = [r for r in records if r["step"] >= 2] or records[1:] or records
    step_s = sum(r["step_time_s"] for r in timed) / len(timed)
    peaks = {}
    for record in records:
        for device, value in (record.get("peak_memory_bytes") or {}).items():
            peaks[device] = max(peaks.get(device, 0), value or 0)
    return {
        "steps": len(records),
        "timed_steps": len(timed),
        "step_time_s": step_s,
        "first_step_s": records[0]["step_time_s"],
        "tokens_per_s": tokens_per_step / step_s,
        "mfu": flops_per_step / peak_flops / step_s,
        "medley_mfu": timed[-1].get("mfu"),
        "peak_memory_bytes": peaks,
        "losses": [r["loss"] for r in records],
        "wall_s": done.seconds,
        "outside_steps_s": done.seconds - sum(r["step_time_s"] for r in records),
        "started": done.started,
        "first_step_started": done.started + done.seconds - sum(r["step_time_s"] for r in records),
    }


def refusal(args: list[str], *, env: dict[str, str] | None, timeout: float) -> dict:
    """What medley does with a plan of more ranks than this machine has GPUs (the issue wants one
    line, exit 2, no rank started)."""
    done = medley(
        ["train", *args, "--steps", "1", "--data", "synthetic", "--json"],
        timeout=timeout,
        env=env,
        check=False,
    )
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return {
        "command": "medley " + " ".join(["train", *args, "--steps", "1", "--data", "synthetic", "--json"]),
        "rc": done.rc,
        "stderr_lines": len(lines),
        "first_line": lines[0] if lines else "",
        "seconds": round(done.seconds, 1),
        "refused": done.rc == 2 and len(lines) == 1,
        "trained": done.rc == 0,
    }


def compare_losses(ranks: list[float], single: list[float]) -> dict[str, Any]:
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ranks, single, strict=False)]
    return {
        "losses": ranks,
        "single_process_losses": single,
        "max_rel_diff": max(diffs) if diffs else None,
        "same_length": len(ranks) == len(single),
    }
