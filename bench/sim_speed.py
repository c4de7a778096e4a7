"""Simulator throughput: how fast :func:`medley.sim.simulate` times generated schedules.

Run: ``.venv/bin/python bench/sim_speed.py [--repeats N]``. Writes bench/results/sim_speed.json
(with the commit and command that made it) and bench/results/sim_speed.md, whose every figure is
read from that JSON. Each case is timed end to end (flattening the schedule, the event loop,
assembling the report) as the best of ``repeats`` runs in this one process (one core).

The speed is in **executed ops** per second, as the engine counts them
(:attr:`medley.sim.SimResult.executed_ops`): compute actions, sends (one per pipeline transfer),
collective issues and local ZeRO actions. RECVs are not counted: the engine posts receives early
and never executes them (earlier versions of this bench counted a RECV per transfer and so
overstated the speed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from provenance import provenance

from medley.cost.interfaces import Collective
from medley.schedule.generators import generate
from medley.sim import SimProblem, StageCost, simulate

RESULTS = Path(__file__).parent / "results"
GOAL_S = 1.0  # GOAL_PP stages x GOAL_M micro-batches, 1F1B, one core
GOAL_PP, GOAL_M = 64, 512

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
    return {
        "family": family, "pp": pp, "micro_batches": micro_batches, "knobs": knobs, "comm": with_comm,
        "compute_actions": compute, "transfers": len(result.transfers), "executed_ops": result.executed_ops,
        "seconds": best, "ops_per_s": result.executed_ops / best, "simulated_step_s": result.step_time_s,
    }


def write_markdown(payload: dict, path: Path) -> None:
    """The report, every figure taken from ``payload`` (what sim_speed.json holds)."""
    env, rows = payload["environment"], payload["cases"]
    goal = [r for r in rows if _is_goal(r, payload)]
    slowest = max(r["seconds"] for r in goal)
    lines = [
        "# Simulator speed",
        "",
        f"Commit `{payload['commit']}`, command `{payload['command']}`.",
        "",
        f"Best of {payload['repeats']} repeats, one process, Python {env['python']} on {env['machine']} "
        f"({env['cores']} cores, load average {env['load_average']:.1f} when measured). "
        f"Goal: 1F1B {payload['goal_pp']} stages x {payload['goal_micro_batches']} micro-batches under "
        f"{payload['goal_s']:g} s: "
        + (f"met (slowest of its cases {slowest:.3f} s)." if payload["goal_met"]
           else f"MISSED (slowest of its cases {slowest:.3f} s)."),
        "",
        "Executed ops are what the engine runs (`SimResult.executed_ops`): compute actions, one send "
        "per transfer, collective issues and local ZeRO actions; receives are posted early and not "
        f"executed, so not counted. Speed ranges from {min(r['ops_per_s'] for r in rows):,.0f} to "
        f"{max(r['ops_per_s'] for r in rows):,.0f} executed ops/s over these cases.",
        "",
        "| schedule | pp | micro-batches | comm | compute actions | transfers | executed ops | time (s) "
        "| executed ops/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["family"] + "".join(f" {k}={v}" for k, v in row["knobs"].items())
        lines.append(
            f"| {name} | {row['pp']} | {row['micro_batches']} | {'on' if row['comm'] else 'off'} | "
            f"{row['compute_actions']:,} | {row['transfers']:,} | {row['executed_ops']:,} | "
            f"{row['seconds']:.3f} | {row['ops_per_s']:,.0f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _is_goal(row: dict, payload: dict) -> bool:
    return (row["family"] == "1f1b" and row["pp"] == payload["goal_pp"]
            and row["micro_batches"] == payload["goal_micro_batches"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per case; the best counts")
    args = parser.parse_args()
    rows = [measure(case, args.repeats) for case in CASES]
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        **provenance(), "repeats": args.repeats,
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cores": os.cpu_count(), "load_average": os.getloadavg()[0]},
        "goal_s": GOAL_S, "goal_pp": GOAL_PP, "goal_micro_batches": GOAL_M, "cases": rows,
    }
    payload["goal_met"] = all(r["seconds"] < GOAL_S for r in rows if _is_goal(r, payload))
    (RESULTS / "sim_speed.json").write_text(json.dumps(payload, indent=2) + "\n")
    write_markdown(json.loads((RESULTS / "sim_speed.json").read_text()), RESULTS / "sim_speed.md")
    for row in rows:
        print(f"{row['family']:>12} pp={row['pp']:<3} m={row['micro_batches']:<4} comm={row['comm']!s:<5} "
              f"{row['executed_ops']:>7} ops in {row['seconds']:.3f} s = {row['ops_per_s']:,.0f}/s")
    slowest = max((r["seconds"] for r in rows if _is_goal(r, payload)), default=0.0)
    print(f"goal: 1F1B {GOAL_PP} stages x {GOAL_M} micro-batches under {GOAL_S:g} s: "
          f"{'met' if payload['goal_met'] else 'MISSED'} (slowest of its cases {slowest:.3f} s)")


if __name__ == "__main__":
    main()
