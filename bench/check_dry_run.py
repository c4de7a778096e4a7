"""The dry run of the 1,024-device LLaMA-2-70B plan: `medley check`'s time and its per-rank figures.

Run: .venv/bin/python bench/check_dry_run.py [--plan PLAN]   (writes bench/results/check_dry_run.{json,md})

The plan is the planner bench's large case (examples/large-1024.toml, LLaMA-2-70B, 1,024 x 4,096;
kept as tests/data/large-1024-70b.toml: pp 12 x dp 32, TP 2, ZeRO-1, fp16, 768 ranks). The dry run
(:func:`medley.cli.check_cmd.dry_run`) builds each set of alike ranks at both ends of its ZeRO
groups in torch's fake process group on the meta device, counts what each holds against the memory
model, and checks a checkpoint of the plan loads under the model on one rank. Goal: under 5 minutes
on 2 cores. Times are wall clock and this process's CPU time (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from provenance import provenance

from medley.cli.check_cmd import dry_run
from medley.dryrun.traced_bytes import FIGURES, TOLERANCE
from medley.plan.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "data" / "large-1024-70b.toml"
GOAL_S = 300.0
GIB = 2**30


def _figures(state: object) -> dict[str, float]:
    return {"static": state.static, **{name: getattr(state, name) for name in FIGURES}}  # type: ignore[attr-defined]


def run(plan_path: Path) -> dict:
    plan = load_plan(plan_path)
    wall, cpu = time.perf_counter(), time.process_time()
    result = dry_run(plan)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ranks = []
    for r in result.reports:
        built, predicted = _figures(r.built), _figures(r.predicted)
        ranks.append({
            "rank": r.rank, "alike_ranks": len(r.case.ranks), "stages": list(r.case.stages),
            "layers": [list(span) for span in r.case.layers], "tp": r.case.tp, "zero": list(r.case.levels),
            "zero_dp": r.case.zero_dp, "built": built, "predicted": predicted,
            "worst_off": max(abs(built[n] - predicted[n]) / predicted[n] for n in built if predicted[n]),
            "activations": {"traced": r.activations, "formula": r.predicted_activations},
            "groups": {name: len(members) for name, members in r.groups.items()},
        })
    return {
        **provenance(),
        "plan": str(plan_path.relative_to(ROOT) if plan_path.is_relative_to(ROOT) else plan_path),
        "world_size": plan.world_size,
        "ranks_built": len(result.reports),
        "cases": len({r.case.rank for r in result.reports}),
        "wall_s": wall, "cpu_s": cpu, "build_s": result.build_s, "checkpoint_s": result.checkpoint_s,
        "goal_s": GOAL_S, "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.processor() or platform.machine(),
        "tolerance": TOLERANCE,
        "checkpoint": {"entries": result.entries, "loads_under": result.loader,
                       "entries_needed": result.loaded_entries},
        "ranks": ranks,
    }


def markdown(data: dict) -> str:
    within = sum(r["worst_off"] <= data["tolerance"] for r in data["ranks"])
    lines = [
        "# Dry run of the 1,024-device LLaMA-2-70B plan (`medley check`)", "",
        f"Commit `{data['commit']}`, command `{data['command']}`.", "",
        f"- Plan `{data['plan']}`: {data['world_size']:,} ranks; {data['ranks_built']} built "
        f"({data['cases']} sets of alike ranks, each at both ends of its ZeRO groups).",
        f"- Time: {data['wall_s']:.1f} s wall, {data['cpu_s']:.1f} s CPU on {data['cpus']} cores "
        f"(building and counting {data['build_s']:.1f} s, checkpoint check {data['checkpoint_s']:.1f} s); "
        f"goal under {data['goal_s']:.0f} s: {'met' if data['wall_s'] < data['goal_s'] else 'missed'}.",
        f"- Model state within {data['tolerance']:.0%} of the memory model's prediction on {within} of "
        f"{len(data['ranks'])} ranks built (every figure: static, parameters, optimizer state, gradient, "
        "gradient shard, ZeRO-3 gathered weights).",
        f"- Checkpoint: {data['checkpoint']['entries']:,} entries, every tensor's chunks tile it; loads "
        f"under {data['checkpoint']['loads_under']} ({data['checkpoint']['entries_needed']:,} entries).",
        "- Activations: one micro-batch's forward traced under fake tensors (CPU autocast, torch's CPU "
        "attention kernel) against medley.cost.formulas.layer_activation_bytes (with autocast's weight "
        "copies, as the compiler books them); reported, not checked. The traced bytes are about 1.45x "
        "the formulas' on these blocks, mostly fp32 copies of the residual stream kept around the RMSNorms "
        "(4 x batch x seq x hidden x 4 B per block) that the formulas count in the compute dtype.", "",
        "| rank | alike | stage (layers) | tp | ZeRO | dp | static GiB built / predicted | parameters | "
        "optimizer | gradient | grad shard | worst off | activations GiB traced / formula |",
        "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["ranks"]:
        b, p = r["built"], r["predicted"]
        layers = " ".join(f"{a}-{z - 1}" for a, z in r["layers"])
        lines.append(
            f"| {r['rank']} | {r['alike_ranks']} | {','.join(map(str, r['stages']))} ({layers}) | "
            f"{r['tp']} | {','.join(map(str, r['zero']))} | {r['zero_dp']} | "
            f"{b['static'] / GIB:.3f} / {p['static'] / GIB:.3f} | "
            f"{b['parameters'] / GIB:.3f} | {b['optimizer'] / GIB:.3f} | {b['gradient'] / GIB:.3f} | "
            f"{b['grad_shard'] / GIB:.3f} | {r['worst_off']:.2%} | "
            f"{r['activations']['traced'] / GIB:.3f} / {r['activations']['formula'] / GIB:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=PLAN)
    parser.add_argument("--markdown-only", action="store_true",
                        help="Write the Markdown from the JSON already there (no dry run)")
    args = parser.parse_args()
    out = ROOT / "bench" / "results"
    if args.markdown_only:
        (out / "check_dry_run.md").write_text(markdown(json.loads((out / "check_dry_run.json").read_text())))
        return
    data = run(args.plan)
    (out / "check_dry_run.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "check_dry_run.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
