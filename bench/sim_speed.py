"""Simulator throughput: how fast :func:`medley.sim.simulate` times generated schedules.

Run: ``.venv/bin/python bench/sim_speed.py [--repeats N]``. Writes bench/results/sim_speed.json and
bench/results/sim_speed.md. Each case is timed end to end (flattening the schedule, the event
loop, assembling the report) as the best of ``repeats`` runs in this one process (one core).
Actions counted: compute actions plus, for each pipeline transfer, its SEND and its RECV (the
lowered program), so the figures compare with schedules that arrive already lowered.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from medley.cost.interfaces import Collective
from medley.schedule.generators import generate
from medley.sim import SimProblem, StageCost, simulate

RESULTS = Path(__file__).parent / "results"
GOAL_S = 1.0  # 64 stages x 512 micro-batches, 1F1B, one core

CASES = [  # (family, pp, micro-batches, knobs, with communication)
    ("1f1b", 8, 64, {}, False),
    ("1f1b", 16, 128, {}, True),
    ("1f1b", 32, 256, {}, True),
    ("1f1b", 64, 512, {}, False),
    ("1f1b", 64, 512, {}, True),
    ("zb-h1", 64, 512, {}, True),
    ("interleaved", 32, 256, {"virtual_stages": 2}, True),
]


class TwoTierComm:
    """α-β with 8 devices per node: NVLink-like inside a node, one shared NIC link per node pair."""

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        same_node = src // 8 == dst // 8
        return (2e-6 + nbytes / 150e9) if same_node else (10e-6 + nbytes / 12e9)

    def collective_time(self, op: Collective, devices: tuple[int, ...], nbytes: float) -> float:
        d = len(devices)
        return (d - 1) * (10e-6 + nbytes / d / 12e9)

    def path_links(self, src: int, dst: int) -> tuple[str, ...]:
        a, b = src // 8, dst // 8
        return (f"nvlink{src}->{dst}",) if a == b else (f"nic{a}-out", f"nic{b}-in")


def make_problem(family: str, pp: int, micro_batches: int, knobs: dict, with_comm: bool) -> SimProblem:
    schedule = generate(family, pp=pp, micro_batches=micro_batches, **knobs)
    costs = [StageCost(forward_s=0.010 * (1 + 0.1 * (s % 3)), backward_input_s=0.011, backward_weight_s=0.009,
                       activation_bytes=2**28, activation_after_b_bytes=2**26, send_bytes=2**24)
             for s in range(schedule.num_stages)]
    return SimProblem(schedules=[schedule], devices=[list(range(pp))], stage_costs=[costs],
                      comm=TwoTierComm() if with_comm else None,
                      peak_flops={d: 312e12 for d in range(pp)}, model_flops_per_step=1e15,
                      tokens_per_step=micro_batches * 2048.0)


def measure(case: tuple, repeats: int) -> dict:
    family, pp, micro_batches, knobs, with_comm = case
    problem = make_problem(family, pp, micro_batches, knobs, with_comm)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = simulate(problem)
        best = min(best, time.perf_counter() - start)
    compute = sum(len(timeline) for timeline in result.compute.values())
    actions = compute + 2 * len(result.transfers)
    return {
        "family": family, "pp": pp, "micro_batches": micro_batches, "knobs": knobs, "comm": with_comm,
        "compute_actions": compute, "transfers": len(result.transfers), "actions": actions,
        "seconds": best, "actions_per_s": actions / best, "simulated_step_s": result.step_time_s,
    }


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# Simulator speed",
        "",
        f"Best of the repeats, one process, Python {platform.python_version()} on {platform.machine()} "
        f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} when measured). "
        f"Goal: 1F1B 64 stages x 512 micro-batches under {GOAL_S:.0f} s.",
        "",
        "| schedule | pp | micro-batches | comm | compute actions | transfers | actions | time (s) "
        "| actions/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["family"] + "".join(f" {k}={v}" for k, v in row["knobs"].items())
        lines.append(
            f"| {name} | {row['pp']} | {row['micro_batches']} | {'on' if row['comm'] else 'off'} | "
            f"{row['compute_actions']:,} | {row['transfers']:,} | {row['actions']:,} | "
            f"{row['seconds']:.3f} | {row['actions_per_s']:,.0f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [measure(case, args.repeats) for case in CASES]
    goal = [r for r in rows if r["family"] == "1f1b" and r["pp"] == 64 and r["micro_batches"] == 512]
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"goal_s": GOAL_S, "goal_met": all(r["seconds"] < GOAL_S for r in goal), "cases": rows}
    (RESULTS / "sim_speed.json").write_text(json.dumps(payload, indent=2) + "\n")
    write_markdown(rows, RESULTS / "sim_speed.md")
    for row in rows:
        print(f"{row['family']:>12} pp={row['pp']:<3} m={row['micro_batches']:<4} comm={row['comm']!s:<5} "
              f"{row['actions']:>7} actions in {row['seconds']:.3f} s = {row['actions_per_s']:,.0f}/s")
    print("goal met" if payload["goal_met"] else "goal MISSED")


if __name__ == "__main__":
    main()
