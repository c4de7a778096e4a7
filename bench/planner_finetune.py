"""The planner bench's fine-tuning section: a lab's mixed GPUs (6 RTX 3090, 2 A100-80GB, 4 T4 over
10 GbE: examples/lab-mixed-12.toml) planned for Llama-3-8B and Llama-3-70B, full training and
LoRA (rank 16 on every block linear layer, the base frozen), by ``medley plan``'s search.

    .venv/bin/python bench/planner_finetune.py [--global-batch 64] [--seq-len 2048]

Per case: the best plan's shape, predicted tokens/s and step time (the simulator, catalog costs),
the precision, the peak memory per device type against its capacity, the devices it leaves idle
and the search's wall time; or, where nothing fits, the search's one-line reason. QLoRA is not
planned (medley has no 4-bit base yet).

Writes bench/results/planner_finetune.json and bench/results/planner_finetune.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from provenance import provenance

from medley.errors import MedleyInputError
from medley.search.planner import search
from medley.search.space import Constraints
from medley.spec.adapter import LoraSpec
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

ROOT = Path(__file__).parents[1]
OUT = ROOT / "bench" / "results"
CLUSTER = "examples/lab-mixed-12.toml"
MODELS = ("llama-3-8b", "llama-3-70b")
LORA = LoraSpec(rank=16, alpha=32.0)


def case(model_name: str, lora: LoraSpec | None, *, global_batch: int, seq_len: int) -> dict:
    cluster = parse_cluster_arg(str(ROOT / CLUSTER))
    row: dict = {"model": model_name, "training": "full" if lora is None else f"LoRA r{lora.rank}"}
    start = time.perf_counter()
    try:
        result = search(cluster, get_model(model_name), global_batch=global_batch, seq_len=seq_len,
                        constraints=Constraints(adapter=lora), baselines=False)
    except MedleyInputError as err:
        return {**row, "fits": False, "reason": str(err), "search_s": time.perf_counter() - start}
    row["search_s"] = time.perf_counter() - start
    best = result.best
    plan = best.plan
    peaks: dict[str, float] = {}
    for report in best.result.devices:
        name = cluster.devices[report.device].type.name
        peaks[name] = max(peaks.get(name, 0.0), report.peak_memory_bytes / 1e9)
    idle = sorted(set(range(cluster.num_devices)) - set(plan.devices))
    groups = [f"{g.schedule} pp {g.pp} x dp {g.dp}" + (f" tp {','.join(map(str, g.tp))}" if any(
        t > 1 for t in g.tp) else "") for g in plan.groups]
    return {**row, "fits": True, "tokens_per_s": best.tokens_per_s,
            "step_time_s": best.prediction.step_time_s,
            "shape": " + ".join(groups), "zero": [[z.level for z in g.zero] for g in plan.groups],
            "recompute": [[str(r) for r in g.recompute] for g in plan.groups], "dtype": plan.shared.dtype,
            "peak_gb_by_type": peaks,
            "capacity_gb_by_type": {t.name: t.memory_gb for t in cluster.device_types().values()},
            "idle_devices": [f"{d} ({cluster.devices[d].type.name})" for d in idle]}


def markdown(data: dict) -> str:
    lines = ["# Planner: fine-tuning on a lab's mixed GPUs", "",
             f"Commit `{data['commit']}`, `{data['command']}`. Cluster {CLUSTER} (6 RTX 3090-24GB, "
             "2 A100-80GB, 4 T4-16GB; 10 GbE between the nodes), "
             f"global batch {data['global_batch']} x {data['seq_len']} tokens, catalog costs, "
             "`medley plan`'s search without baselines. LoRA: rank 16 (alpha 32) on "
             "q, k, v, o, gate, up, down of every block, the rest frozen.", "",
             "| model | training | fits | predicted tokens/s | step | plan | dtype | peak GB per type "
             "(capacity) | idle devices | search |", "|---|---|---|---:|---:|---|---|---|---|---:|"]
    for r in data["rows"]:
        if not r["fits"]:
            lines.append(f"| {r['model']} | {r['training']} | no | - | - | {r['reason'][:160]} | | | | "
                         f"{r['search_s']:.1f} s |")
            continue
        peaks = ", ".join(f"{t} {gb:.1f} ({r['capacity_gb_by_type'][t]:.0f})"
                          for t, gb in sorted(r["peak_gb_by_type"].items()))
        lines.append(f"| {r['model']} | {r['training']} | yes | {r['tokens_per_s']:,.0f} | "
                     f"{r['step_time_s']:.2f} s | {r['shape']}, ZeRO {r['zero']} | {r['dtype']} | {peaks} | "
                     f"{', '.join(r['idle_devices']) or 'none'} | {r['search_s']:.1f} s |")
    fits = {(r["model"], r["training"]): r for r in data["rows"] if r["fits"]}
    for model in MODELS:
        full, lora = fits.get((model, "full")), fits.get((model, f"LoRA r{LORA.rank}"))
        if full and lora:
            lines += ["", f"{model}: LoRA predicts {lora['tokens_per_s'] / full['tokens_per_s']:.2f}x full "
                      "training's tokens/s (no base weight gradients, no base optimizer state: fewer "
                      "stages, less recomputation)."]
    lines += ["", "The frozen base is booked as medley's runtime holds it: in the compute dtype (2 B per "
              "parameter, FSDP2's shard beside the gathered weights from ZeRO-1), no fp32 master, gradient "
              "or optimizer state; QLoRA's 4-bit base is not built."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    data: dict = {**provenance(), "global_batch": args.global_batch, "seq_len": args.seq_len, "rows": []}
    for model in MODELS:
        for lora in (None, LORA):
            row = case(model, lora, global_batch=args.global_batch, seq_len=args.seq_len)
            print(json.dumps(row), flush=True)
            data["rows"].append(row)
    OUT.mkdir(exist_ok=True)
    (OUT / "planner_finetune.json").write_text(json.dumps(data, indent=1) + "\n")
    (OUT / "planner_finetune.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
