"""Exposed ZeRO communication: bubble-aware placement against naive, over model x cluster cases.

Run: .venv/bin/python bench/zero_placement.py   (writes bench/results/zero_placement.{json,md}; the
JSON records the commit and command, the Markdown is written from it)

"Exposed" is the simulator's exposed ZeRO time (medley.sim.result): idle time while a stage's own
ZeRO collectives run and block its device, summed over stages (each the worst device of the
stage), so never more than the collectives' own time; waiting for other devices is bubble.
"""

from __future__ import annotations

import json
from pathlib import Path

from provenance import provenance

from medley.cost.estimator import CatalogCostSource
from medley.lowering.predict import simulate_layout
from medley.plan.inline import inline_layout
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    # (name, cluster, model, pp, dp, schedule, micro-batches, zero per stage, gather rounds)
    ("demo llama-2-7b 1f1b", "examples/demo.toml", "llama-2-7b", 3, 4, "1f1b", "16", "3,1,3", 1),
    ("demo llama-2-7b zb-h1", "examples/demo.toml", "llama-2-7b", 3, 4, "zb-h1", "16", "3,3,3", 1),
    ("cloud opt-350m 1f1b", "examples/cloud-a100-v100.toml", "opt-350m", 2, 8, "1f1b", "8", "2,2", 1),
    ("cloud llama-3-8b gpipe", "examples/cloud-a100-v100.toml", "llama-3-8b", 4, 4, "gpipe", "16", "3", 1),
    (
        "v100 llama-2-13b 1f1b streamed",
        "examples/v100-mixed-16.toml",
        "llama-2-13b",
        4,
        4,
        "1f1b",
        "16",
        "1,1,3,3",
        0,
    ),
    (
        "v100 gpt-neo-2.7b interleaved",
        "examples/v100-mixed-16.toml",
        "gpt-neo-2.7b",
        4,
        4,
        "interleaved",
        "8",
        "3",
        1,
    ),
]


def run_case(name, cluster_arg, model_name, pp, dp, schedule, micro_batches, zero, rounds) -> dict:
    cluster = parse_cluster_arg(str(ROOT / cluster_arg))
    model = get_model(model_name)
    cost = CatalogCostSource.for_cluster(model, cluster)
    row: dict = {"case": name, "zero": zero, "schedule": schedule}
    for placement in ("naive", "bubble"):
        layout = inline_layout(
            cluster=cluster,
            model=model,
            cost=cost,
            pp=pp,
            dp=dp,
            schedule=schedule,
            micro_batches=micro_batches,
            micro_batch_size=1,
            seq_len=2048,
            zero=zero,
            zero_placement=placement,
            buckets=4,
            gather_windows=rounds,
            recompute=True,
        )
        _, result = simulate_layout(layout, cluster)
        row[f"{placement}_exposed_s"] = sum(z.exposed_s for z in result.zero.values())
        row[f"{placement}_comm_s"] = sum(z.comm_s for z in result.zero.values())
        row[f"{placement}_step_s"] = result.step_time_s
        row[f"{placement}_bubble_s"] = max(d.bubble_s for d in result.devices)
    row["exposed_ratio"] = row["bubble_exposed_s"] / row["naive_exposed_s"] if row["naive_exposed_s"] else 0.0
    row["goal_met"] = row["exposed_ratio"] <= 0.25
    return row


def main() -> None:
    rows = [run_case(*case) for case in CASES]
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "zero_placement.json").write_text(json.dumps({**provenance(), "cases": rows}, indent=2) + "\n")
    data = json.loads((out / "zero_placement.json").read_text())
    lines = [
        f"Commit `{data['commit']}`, command `{data['command']}`. Exposed: idle time while a stage's own",
        "ZeRO collectives run and block its device (at most their duration), summed over stages.",
        "",
        "| case | ZeRO | naive exposed (s) | bubble exposed (s) | ratio | naive step (s) | bubble step (s) "
        "| goal <= 0.25 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["cases"]:
        lines.append(
            f"| {r['case']} | {r['zero']} | {r['naive_exposed_s']:.3f} | {r['bubble_exposed_s']:.3f} | "
            f"{r['exposed_ratio']:.2f} | {r['naive_step_s']:.3f} | {r['bubble_step_s']:.3f} | "
            f"{'yes' if r['goal_met'] else 'no'} |"
        )
    (out / "zero_placement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
