"""Planner benchmark: search time, speed-up over the baselines, optimality gap, bound fraction.

    timeout 5400 python bench/planner.py                   # everything (long on a busy machine)
    python bench/planner.py --sections gap,bound           # the small instances only
    python bench/planner.py --sizes 16,64 --models llama-2-7b,llama-2-13b

Writes bench/results/planner.json and bench/results/planner.md. Clusters are synthetic but shaped
like examples/large-1024.toml: nodes of 8 devices, racks of up to 8 nodes of one type (200 Gb/s),
two zones (100 Gb/s inside, 25 Gb/s and 1 ms between them), prices per device hour. Costs are the
catalog estimate unless a case names the public Metis-format profiles. Sections:

1. ``search``: search time (one process, one core, baselines excluded) for 16/64/256/1024 devices
   of 2-4 types and LLaMA-2-7B, 13B, 70B and GPT-3-175B at two sequences per device; the best
   plan's simulated throughput, its ratio to each baseline and to the best single-type plan
   (searched separately with the other types excluded), and its fraction of the aggregate bound.
2. ``gap``: on instances of up to 16 devices, the planner's best against an exhaustive search that
   simulates every candidate of the planner's space (every structure x family, no pruning).
3. ``bound``: fraction of the aggregate bound against samples per device (LLaMA-2-7B, 2,048
   tokens per sequence).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from provenance import provenance

from medley.cost.estimator import CatalogCostSource
from medley.cost.metis import MetisCostSource
from medley.errors import MedleyInputError
from medley.plan.candidates import Estimator
from medley.plan.ranking import rank_plan
from medley.plan.search import device_pools, family_variants, search
from medley.plan.space import DEFAULT_FAMILIES, MICRO_BATCH_SIZES, Constraints
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict, parse_cluster_arg
from medley.spec.model_arg import get_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROFILES = ROOT / "tests" / "data" / "metis-opt-350"
TYPES = [("H100-SXM-80GB", 2.99), ("A100-80GB", 1.79), ("V100-32GB", 0.99), ("L4-24GB", 0.71)]
SIZES = {16: 2, 64: 4, 256: 4, 1024: 4}
MODELS = ("llama-2-7b", "llama-2-13b", "llama-2-70b", "gpt-3-175b")


def synthetic_cluster(num_devices: int, num_types: int) -> Cluster:
    """``num_devices`` split evenly over the first ``num_types`` of TYPES, 8 per node."""
    per_type = num_devices // num_types
    nodes, racks = [], {}
    for t, (device, price) in enumerate(TYPES[:num_types]):
        node_count = max(1, per_type // 8)
        count = min(8, per_type)
        for rack in range((node_count + 7) // 8):
            in_rack = min(8, node_count - 8 * rack)
            name = f"t{t}-r{rack}"
            nodes.append(
                {"name": name, "device": device, "count": count, "repeat": in_rack, "price_per_hour": price}
            )
            racks[f"rack-{name}"] = [f"{name}-*"] if in_rack > 1 else [name]
    names = list(racks)
    half = (len(names) + 1) // 2
    zones = {"zone-a": names[:half], "zone-b": names[half:]} if len(names) > 1 else {"zone-a": names}
    tiers = [
        {"name": "rack", "bandwidth_gbit": 200, "latency_us": 5, "groups": racks},
        {"name": "zone", "bandwidth_gbit": 100, "latency_us": 10, "groups": zones},
        {"name": "region", "bandwidth_gbit": 25, "latency_us": 1000},
    ]
    raw = {"name": f"synthetic-{num_devices}x{num_types}", "nodes": nodes, "tiers": tiers}
    return cluster_from_dict(raw, source=raw["name"])


def seq_len_of(model: str) -> int:
    return 4096 if model.startswith("llama") else 2048


def _single_type_best(cluster: Cluster, model, global_batch: int, seq_len: int, cost) -> tuple[float, str]:
    """Best simulated tokens/s of a plan on one device type alone (0 when none fits)."""
    best = (0.0, "")
    for name, ids in cluster.devices_by_type().items():
        others = tuple(d for d in range(cluster.num_devices) if d not in set(ids))
        try:
            result = search(
                cluster,
                model,
                global_batch=global_batch,
                seq_len=seq_len,
                cost=cost,
                top=1,
                constraints=Constraints(exclude_devices=others),
                baselines=False,
            )
        except MedleyInputError:
            continue
        best = max(best, (result.best.tokens_per_s, name))
    return best


def search_case(num_devices: int, model_name: str, *, singles: bool) -> dict:
    cluster = synthetic_cluster(num_devices, SIZES[num_devices])
    model = get_model(model_name)
    seq_len, global_batch = seq_len_of(model_name), 2 * num_devices
    row: dict = {
        "devices": num_devices,
        "types": SIZES[num_devices],
        "model": model_name,
        "global_batch": global_batch,
        "seq_len": seq_len,
    }
    cost = CatalogCostSource.for_cluster(model, cluster)
    start = time.process_time()
    wall = time.perf_counter()
    try:
        result = search(
            cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1, baselines=False
        )
    except MedleyInputError as err:
        row.update(
            search_cpu_s=time.process_time() - start,
            search_wall_s=time.perf_counter() - wall,
            fits=False,
            message=str(err)[:300],
        )
        return row
    row.update(search_cpu_s=time.process_time() - start, search_wall_s=time.perf_counter() - wall, fits=True)
    best = result.best
    layout = best.plan.layout
    row.update(
        tokens_per_s=best.tokens_per_s,
        step_time_s=best.prediction.step_time_s,
        plan=f"{best.candidate.structure.pool} pp={layout.pp} dp={layout.dp} {layout.schedule} "
        f"mbs={layout.micro_batch_size}",
        simulated=len(result.simulated),
        structures=result.structures_estimated,
        aggregate_fraction=best.tokens_per_s / result.aggregate_tokens_per_s,
    )
    estimator = Estimator(
        cluster, model, cost, seq_len=seq_len, global_batch=global_batch, memory_headroom=0.05
    )
    from medley.plan.baselines import run_baselines

    sizes = tuple(s for s in MICRO_BATCH_SIZES if global_batch % s == 0)
    t0 = time.perf_counter()
    baselines = run_baselines(estimator, list(range(cluster.num_devices)), sizes, Constraints())
    row["baselines_wall_s"] = time.perf_counter() - t0
    row["versus"] = {
        n: (None if b is None else best.tokens_per_s / b.tokens_per_s) for n, b in baselines.items()
    }
    found = [b.tokens_per_s for b in baselines.values() if b is not None]
    row["versus_best_baseline"] = best.tokens_per_s / max(found) if found else None
    if singles:
        single, name = _single_type_best(cluster, model, global_batch, seq_len, cost)
        row["best_single_type"] = name
        row["versus_best_single_type"] = best.tokens_per_s / single if single else None
    return row


def exhaustive_best(cluster: Cluster, model, global_batch: int, seq_len: int, cost) -> tuple[float, int]:
    """Simulate every candidate of the planner's space (no pruning); best feasible tokens/s."""
    estimator = Estimator(
        cluster, model, cost, seq_len=seq_len, global_batch=global_batch, memory_headroom=0.05
    )
    devices = list(range(cluster.num_devices))
    pools = device_pools(cluster, devices, estimator)
    sizes = tuple(s for s in MICRO_BATCH_SIZES if global_batch % s == 0)
    best, count = 0.0, 0
    seen = set()
    for structure in estimator.structures(pools, max_pp=model.num_layers, micro_batch_sizes=sizes):
        for family, knobs in family_variants(DEFAULT_FAMILIES):
            try:
                candidate = estimator.candidate(structure, family, **knobs)
            except ValueError:
                continue
            if candidate is None or candidate.key in seen:
                continue
            seen.add(candidate.key)
            try:
                ranked = rank_plan(candidate, candidate.layout(model, seq_len), cluster, cost, 0.05)
            except ValueError:  # a layout the compiler rejects
                continue
            count += 1
            if ranked.fits:
                best = max(best, ranked.tokens_per_s)
    return best, count


def gap_cases() -> list[tuple[str, Cluster, str, int, str]]:
    return [
        (
            "8xA100-40GB+8xV100-16GB, Metis profiles",
            parse_cluster_arg("8xA100-40GB+8xV100-16GB"),
            "opt-350m",
            64,
            "metis",
        ),
        ("4xH100+4xA100-80GB", parse_cluster_arg("4xH100-SXM-80GB+4xA100-80GB"), "llama-2-7b", 32, "catalog"),
        ("synthetic 16 x 2 types", synthetic_cluster(16, 2), "llama-2-13b", 32, "catalog"),
        (
            "demo (4 A100 + 4 V100 + 4 T4)",
            parse_cluster_arg(str(ROOT / "examples" / "demo.toml")),
            "llama-2-7b",
            24,
            "catalog",
        ),
    ]


def gap_case(label: str, cluster: Cluster, model_name: str, global_batch: int, source: str) -> dict:
    model = get_model(model_name)
    seq_len = 2048
    catalog = CatalogCostSource.for_cluster(model, cluster)
    cost = MetisCostSource.from_directory(PROFILES, model, fallback=catalog) if source == "metis" else catalog
    wall = time.perf_counter()
    result = search(
        cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1, baselines=False
    )
    planner_s = time.perf_counter() - wall
    wall = time.perf_counter()
    exhaustive, count = exhaustive_best(cluster, model, global_batch, seq_len, cost)
    return {
        "case": label,
        "model": model_name,
        "global_batch": global_batch,
        "costs": source,
        "planner_tokens_per_s": result.best.tokens_per_s,
        "planner_wall_s": planner_s,
        "planner_simulated": len(result.simulated),
        "exhaustive_tokens_per_s": exhaustive,
        "exhaustive_simulated": count,
        "exhaustive_wall_s": time.perf_counter() - wall,
        "gap": 1.0 - result.best.tokens_per_s / exhaustive if exhaustive else None,
    }


def bound_cases() -> list[tuple[str, Cluster, str, int]]:
    out = []
    for per_device in (1, 2, 8, 16):
        out.append(("synthetic 16 x 2 types", synthetic_cluster(16, 2), "llama-2-7b", per_device))
    for per_device in (2, 8):
        out.append(("synthetic 64 x 4 types", synthetic_cluster(64, 4), "llama-2-7b", per_device))
    return out


def bound_case(label: str, cluster: Cluster, model_name: str, per_device: int) -> dict:
    model = get_model(model_name)
    global_batch = per_device * cluster.num_devices
    result = search(cluster, model, global_batch=global_batch, seq_len=2048, top=1)
    found = [b.tokens_per_s for b in result.baselines.values() if b is not None]
    return {
        "case": label,
        "model": model_name,
        "samples_per_device": per_device,
        "global_batch": global_batch,
        "tokens_per_s": result.best.tokens_per_s,
        "aggregate_tokens_per_s": result.aggregate_tokens_per_s,
        "aggregate_fraction": result.best.tokens_per_s / result.aggregate_tokens_per_s,
        "versus_best_baseline": result.best.tokens_per_s / max(found) if found else None,
    }


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(data: dict) -> str:
    lines = ["# Planner benchmark", "", f"Machine: {data['machine']}", ""]
    for section in ("search", "gap", "bound"):
        made = data.get("provenance", {}).get(section)
        if data.get(section):
            how = (f"commit `{made['commit']}`, command `{made['command']}`" if made
                   else "commit not recorded (measured before results recorded it)")
            lines.append(f"- {section}: {how}")
    lines.append("")
    if data.get("search"):
        lines += [
            "## Search time and plan quality (2 sequences per device, catalog costs)",
            "",
            "| devices | types | model | search s (cpu) | simulated | best plan | tokens/s | "
            "vs megatron-style | vs fastest-type | vs metis-style | vs best single-type | of bound |",
            "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in data["search"]:
            if not r.get("fits"):
                lines.append(
                    f"| {r['devices']} | {r['types']} | {r['model']} | {r['search_cpu_s']:.1f} | - | "
                    f"fits nowhere | - | - | - | - | - | - |"
                )
                continue
            v = r["versus"]
            lines.append(
                f"| {r['devices']} | {r['types']} | {r['model']} | {r['search_cpu_s']:.1f} | "
                f"{r['simulated']} | {r['plan']} | {r['tokens_per_s']:,.0f} | {_fmt(v['megatron-style'])} | "
                f"{_fmt(v['fastest-type-only'])} | {_fmt(v['metis-style'])} | "
                f"{_fmt(r.get('versus_best_single_type'))} | {r['aggregate_fraction']:.0%} |"
            )
        lines.append("")
    if data.get("gap"):
        lines += [
            "## Optimality gap against exhaustive simulation of the planner's space",
            "",
            "| case | model | global batch | costs | planner tokens/s | exhaustive tokens/s | gap | "
            "planner sims | exhaustive sims |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in data["gap"]:
            lines.append(
                f"| {r['case']} | {r['model']} | {r['global_batch']} | {r['costs']} | "
                f"{r['planner_tokens_per_s']:,.0f} | {r['exhaustive_tokens_per_s']:,.0f} | "
                f"{_fmt(r['gap'], '.1%')} | {r['planner_simulated']} | {r['exhaustive_simulated']} |"
            )
        lines.append("")
    if data.get("bound"):
        lines += [
            "## Fraction of the aggregate bound",
            "",
            "| cluster | model | samples per device | tokens/s | aggregate bound | fraction | "
            "vs best baseline |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in data["bound"]:
            lines.append(
                f"| {r['case']} | {r['model']} | {r['samples_per_device']} | {r['tokens_per_s']:,.0f} | "
                f"{r['aggregate_tokens_per_s']:,.0f} | {r['aggregate_fraction']:.0%} | "
                f"{_fmt(r['versus_best_baseline'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="search,gap,bound")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--singles-up-to",
        type=int,
        default=256,
        help="compare with the best single-type plan on clusters up to this size",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "planner.json")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    data: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f} at start (shared machine: wall times vary)",
    }
    if args.out.exists():
        data = {**json.loads(args.out.read_text()), **data}
    # Sections not run now keep their rows and the provenance they were measured with.
    data["provenance"] = {**data.get("provenance", {}), **{s: provenance() for s in sections}}
    if "search" in sections:
        data["search"] = []
        for size in map(int, args.sizes.split(",")):
            for model in args.models.split(","):
                row = search_case(size, model, singles=size <= args.singles_up_to)
                print(json.dumps(row), flush=True)
                data["search"].append(row)
    if "gap" in sections:
        data["gap"] = []
        for case in gap_cases():
            row = gap_case(*case)
            print(json.dumps(row), flush=True)
            data["gap"].append(row)
    if "bound" in sections:
        data["bound"] = []
        for case in bound_cases():
            row = bound_case(*case)
            print(json.dumps(row), flush=True)
            data["bound"].append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
