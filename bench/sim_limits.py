"""``medley simulate`` at the documented limits, end to end: time and peak memory of each case.

Run: ``.venv/bin/python bench/sim_limits.py [--baseline-src DIR] [--timeout S]``. Writes
bench/results/sim_limits.json (with the commit and command that made it) and
bench/results/sim_limits.md, whose every figure is read from that JSON.

Each case is one fresh ``python -m medley.cli.main simulate ...`` process (the table on stdout,
as a user sees it, sent to /dev/null): wall time, CPU time (user + system: what the case takes on
a quiet machine; this VM's 2 cores are shared) and peak resident memory (``wait4``'s rusage). The
goal, seconds at every documented limit, is judged on CPU time. Two parts:

* the **dp sweep**: ``--model tiny --seq-len 64 --cluster 65536xA100-80GB --pp 1 --micro-batches 1``
  at dp 1,000 to 50,000, the largest the limit of 50,000 stage-micro-batches allows. With
  ``--baseline-src DIR`` (another checkout's ``src``, e.g. the commit before the fix) the sweep also
  runs on that code, each case stopped after ``--timeout`` seconds;
* the **limits**: the largest plans the limits accept (spec/limits.py: 50,000 stage-micro-batches,
  10,000 micro-batches per replica, 1,000,000 simulated actions) in several shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance

from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.world import build_schedules, step_actions
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.limits import MAX_SIM_ACTIONS, MAX_SIM_WORK
from medley.spec.model_arg import get_model

RESULTS = Path(__file__).parent / "results"
GOAL_S = 10.0  # what the documented limits promise: seconds, about 10 at most
SWEEP = [1_000, 2_000, 4_000, 8_000, 16_000, 50_000]
SWEEP_FLAGS = {"model": "tiny", "cluster": "65536xA100-80GB", "pp": 1, "micro_batches": "1"}  # seq-len 64
LIMITS = [  # (name, flags beyond seq_len 64)
    ("dp 50,000 ZeRO-3", {"model": "tiny", "cluster": "65536xA100-80GB", "pp": 1, "dp": 50_000,
                          "micro_batches": "1", "zero": "3"}),
    ("dp 50,000 on three device types", {"model": "tiny", "cluster": "20000xA100-80GB+20000xV100-32GB+"
                                         "10000xT4-16GB", "pp": 1, "dp": 50_000, "micro_batches": "1"}),
    ("pp 8 x 6,250 micro-batches", {"model": "llama-2-7b", "cluster": "8xA100-80GB", "pp": 8, "dp": 1,
                                    "micro_batches": "6250"}),
    ("pp 5 x 10,000 micro-batches", {"model": "tiny", "cluster": "8xA100-80GB", "pp": 5, "dp": 1,
                                     "micro_batches": "10000"}),
    ("pp 64 x 781 micro-batches", {"model": "gpt-3-175b", "cluster": "64xA100-80GB", "pp": 64, "dp": 1,
                                   "micro_batches": "781"}),
    ("zb-h1 pp 8 x 6,250", {"model": "llama-2-7b", "cluster": "8xA100-80GB", "pp": 8, "dp": 1,
                            "micro_batches": "6250", "schedule": "zb-h1"}),
    ("interleaved pp 16 x 2 x 1,562", {"model": "llama-2-7b", "cluster": "16xA100-80GB", "pp": 16, "dp": 1,
                                       "micro_batches": "1562", "schedule": "interleaved"}),
    ("pp 8 x dp 64 x 97 ZeRO-3", {"model": "llama-2-7b", "cluster": "512xA100-80GB", "pp": 8, "dp": 64,
                                  "micro_batches": "97", "zero": "3"}),
    ("ZeRO-3 streamed, 98 buckets, dp 1,690", {"model": "gpt-3-175b", "cluster": "65536xA100-80GB", "pp": 1,
                                               "dp": 1_690, "micro_batches": "1", "zero": "3",
                                               "buckets": 98, "gather_windows": 0}),
]


def argv_of(flags: dict) -> list[str]:
    args = ["simulate", "--seq-len", "64"]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def size_of(flags: dict) -> dict:
    """The case's stage-micro-batches and simulated actions (what the limits count)."""
    cluster, model = parse_cluster_arg(flags["cluster"]), get_model(flags["model"])
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=flags["pp"],
        dp=flags["dp"], schedule=flags.get("schedule", "1f1b"), micro_batches=flags["micro_batches"],
        micro_batch_size=1, seq_len=64, virtual_stages=2, zero=flags.get("zero"),
        buckets=flags.get("buckets", 4), gather_windows=flags.get("gather_windows", 1))
    return {"stage_micro_batches": layout.num_stages * sum(layout.micro_batches),
            "actions": step_actions(build_schedules(layout))}


def run_case(flags: dict, *, src: str | None, timeout: float, memory_gb: float | None = None) -> dict:
    """One fresh process: seconds, peak resident MB, exit status (None: stopped at ``timeout``);
    with ``memory_gb``, its address space is capped there (it fails with MemoryError past it)."""
    env = dict(os.environ, COLUMNS="140")
    if src is not None:
        env["PYTHONPATH"] = src

    def cap() -> None:
        if memory_gb is not None:
            limit = int(memory_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "medley.cli.main", *argv_of(flags)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=cap)
    deadline, status, usage = start + timeout, None, None
    while time.perf_counter() < deadline:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.05)
    else:
        process.kill()
        _, _, usage = os.wait4(process.pid, 0)
        status = None
    seconds = time.perf_counter() - start
    error = process.stderr.read().decode(errors="replace").strip() if process.stderr else ""
    code = None if status is None else os.waitstatus_to_exitcode(status)
    return {"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mb": usage.ru_maxrss / 1024,
            "exit": code, "error": (error.splitlines() or [f"exit {code}"])[-1] if code else ""}


def git_commit(src: str) -> str:
    done = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


def write_markdown(payload: dict, path: Path) -> None:
    """The report, every figure taken from ``payload`` (what sim_limits.json holds)."""
    env = payload["environment"]

    def cell(row: dict | None) -> str:
        if row is None:
            return "not run (a smaller dp already failed)"
        if row["exit"] is None:
            return f"stopped at {row['seconds']:.0f} s ({row['peak_mb']:,.0f} MB)"
        if row["exit"] != 0 and "MemoryError" in row["error"]:
            return f"out of memory at the {baseline['memory_gb']:g} GB cap after {row['seconds']:.0f} s"
        return (f"{row['seconds']:.2f} s ({row['cpu_s']:.2f} s CPU), {row['peak_mb']:,.0f} MB"
                + ("" if row["exit"] == 0 else " (failed)"))

    baseline = payload.get("baseline")
    lines = [
        "# `medley simulate` at the documented limits",
        "",
        f"Commit `{payload['commit']}`, command `{payload['command']}`.",
        "",
        f"One fresh process per case (`python -m medley.cli.main simulate ...`, the table to /dev/null), "
        f"Python {env['python']} on {env['machine']} ({env['cores']} cores shared with other work, load "
        f"average {env['load_average']:.1f} at the end): wall time, the process's CPU time (user + system, "
        "what a quiet machine would take) and peak resident memory. Limits: "
        f"{payload['max_sim_work']:,} stage-micro-batches, {payload['max_sim_actions']:,} actions in the "
        f"step's schedules (compute, ZeRO collectives and optimizer steps of all replicas); goal: every case "
        f"under "
        f"{payload['goal_s']:g} s of CPU: " + ("met" if payload["goal_met"] else "MISSED")
        + f" (most {max(r['cpu_s'] for r in payload['sweep'] + payload['limits']):.2f} s CPU, slowest "
        f"{max(r['seconds'] for r in payload['sweep'] + payload['limits']):.2f} s wall).",
        "",
        "## dp sweep",
        "",
        f"`medley {' '.join(argv_of({**SWEEP_FLAGS, 'dp': 'N'}))}`"
        + (f"; before: the code at `{baseline['commit']}`, each case stopped after "
           f"{baseline['timeout_s']:g} s or {baseline['memory_gb']:g} GB (its memory grew as dp squared)."
           if baseline else "."),
        "",
        "| dp | stage-micro-batches | actions | " + ("before | " if baseline else "") + "now |",
        "|---:|---:|---:|" + ("---:|" if baseline else "") + "---:|",
    ]
    before = {row["dp"]: row for row in baseline["sweep"]} if baseline else {}
    for row in payload["sweep"]:
        lines.append(f"| {row['dp']:,} | {row['stage_micro_batches']:,} | {row['actions']:,} | "
                     + (f"{cell(before.get(row['dp']))} | " if baseline else "") + f"{cell(row)} |")
    lines += ["", "## Other shapes at the limits", "",
              "| case | flags | stage-micro-batches | actions | time, peak memory |",
              "|---|---|---:|---:|---:|"]
    for row in payload["limits"]:
        flags = " ".join(argv_of(row["flags"])[3:])
        lines.append(f"| {row['name']} | `{flags}` | {row['stage_micro_batches']:,} | {row['actions']:,} | "
                     f"{cell(row)} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", help="also run the dp sweep on this src directory (the old code)")
    parser.add_argument("--baseline-label", help="what the baseline is (default: its git commit)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a case is stopped")
    parser.add_argument("--baseline-memory-gb", type=float, default=8.0,
                        help="address space cap of each baseline case (its memory grew as dp squared)")
    args = parser.parse_args()
    sweep = []
    for dp in SWEEP:
        flags = {**SWEEP_FLAGS, "dp": dp}
        sweep.append({"dp": dp, **size_of(flags), **run_case(flags, src=None, timeout=args.timeout)})
        print(f"dp {dp:>6}: {sweep[-1]['seconds']:.2f} s ({sweep[-1]['cpu_s']:.2f} CPU), "
              f"{sweep[-1]['peak_mb']:,.0f} MB", flush=True)
    limits = []
    for name, flags in LIMITS:
        limits.append({"name": name, "flags": flags, **size_of(flags),
                       **run_case(flags, src=None, timeout=args.timeout)})
        print(f"{name}: {limits[-1]['seconds']:.2f} s ({limits[-1]['cpu_s']:.2f} CPU), "
              f"{limits[-1]['peak_mb']:,.0f} MB", flush=True)
    payload = {
        **provenance(),
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cores": os.cpu_count(), "load_average": os.getloadavg()[0]},
        "goal_s": GOAL_S, "max_sim_work": MAX_SIM_WORK, "max_sim_actions": MAX_SIM_ACTIONS,
        "sweep": sweep, "limits": limits,
    }
    payload["goal_met"] = all(r["exit"] == 0 and r["cpu_s"] < GOAL_S for r in sweep + limits)
    if args.baseline_src:
        rows = []
        for dp in SWEEP:  # past a case stopped at the timeout, the larger ones are not run
            rows.append({"dp": dp, **run_case({**SWEEP_FLAGS, "dp": dp}, src=args.baseline_src,
                                              timeout=args.timeout, memory_gb=args.baseline_memory_gb)})
            print(f"before, dp {dp:>6}: {rows[-1]['seconds']:.2f} s, {rows[-1]['peak_mb']:,.0f} MB",
                  flush=True)
            if rows[-1]["exit"] != 0:
                break
        label = args.baseline_label or git_commit(args.baseline_src)
        payload["baseline"] = {"commit": label, "timeout_s": args.timeout,
                               "memory_gb": args.baseline_memory_gb, "sweep": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_limits.json").write_text(json.dumps(payload, indent=2) + "\n")
    write_markdown(json.loads((RESULTS / "sim_limits.json").read_text()), RESULTS / "sim_limits.md")
    print("goal met" if payload["goal_met"] else "goal MISSED")


if __name__ == "__main__":
    main()
