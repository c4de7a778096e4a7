"""Planner benchmark: search time, speed-up over the baselines, where the gain comes from
(ablation), loss from pruning against a reference search, fraction of the aggregate bound.

    timeout 14400 python bench/planner.py                      # everything (hours on a busy machine)
    python bench/planner.py --sections pruning,bound            # the small instances only
    python bench/planner.py --sections large                    # 70B on examples/large-1024.toml
    python bench/planner.py --sections search --sizes 16 --models llama-2-7b   # one small case
    python bench/planner.py --sizes 16,64 --models llama-2-7b,llama-2-13b --ablation-up-to 64

Writes bench/results/planner.json and bench/results/planner.md (bench/planner_report.py; sections
not run keep their rows and the commit and command they were measured with, and so do the search
rows of sizes and models not run: each search row records its own). Clusters are
synthetic but shaped like examples/large-1024.toml: nodes of 8 devices, racks of up to 8 nodes of
one type (200 Gb/s), two zones (100 Gb/s inside, 25 Gb/s and 1 ms between them), prices per
device hour. Costs are the catalog estimate unless a case names the public Metis-format profiles.
Sections:

1. ``search``: search time (one process, one core, baselines excluded; the least of
   ``--timing-runs`` searches, each in a fresh process) for 16/64/256/1024 devices
   of 2-4 types and LLaMA-2-7B, 13B, 70B and GPT-3-175B at two sequences per device; the best
   plan's simulated throughput, its ratio to each baseline (:mod:`medley.search.rank.baselines`) and to
   the best single-type plan (searched separately with the other types excluded), its fraction of
   the aggregate bound, and (up to ``--ablation-up-to`` devices) the ablation
   (:mod:`medley.search.report.ablation`): each freedom's constrained search and share of the gain.
2. ``large``: LLaMA-2-70B on examples/large-1024.toml at 1,024 sequences of 4,096 tokens (the
   planner's headline goal): the best plan's fraction of the aggregate bound, its shape, and the
   search's CPU time as in ``search``.
3. ``pruning``: on instances of up to 16 devices, the planner's best against the reference search
   (:mod:`medley.search.report.reference_search`, ``--reference-budget`` seconds each). The reference is not
   exhaustive over tp (nor, beyond its small seeds, over splits x memory options), hence "loss from
   pruning", not "optimality gap".
4. ``bound``: fraction of the aggregate bound against samples per device (LLaMA-2-7B, 2,048
   tokens per sequence).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import time
from itertools import groupby
from pathlib import Path

from planner_report import markdown
from provenance import provenance

from medley.cost.estimator import CatalogCostSource
from medley.cost.metis import MetisCostSource
from medley.errors import MedleyInputError
from medley.search.estimate.bounds import aggregate_bound
from medley.search.planner import search
from medley.search.rank.baselines import run_baselines
from medley.search.report.ablation import ablate
from medley.search.report.reference_search import reference_search
from medley.search.rules.candidates import Estimator
from medley.search.space import MICRO_BATCH_SIZES, Constraints
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict, parse_cluster_arg
from medley.spec.model_arg import get_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROFILES = ROOT / "tests" / "data" / "metis-opt-350"
TYPES = [("H100-SXM-80GB", 2.99), ("A100-80GB", 1.79), ("V100-32GB", 0.99), ("L4-24GB", 0.71)]
SIZES = {16: 2, 64: 4, 256: 4, 1024: 4}
MODELS = ("llama-2-7b", "llama-2-13b", "llama-2-70b", "gpt-3-175b")


def synthetic_cluster(num_devices: int, num_types: int,
                      types: list[tuple[str, float]] | None = None) -> Cluster:
    """``num_devices`` split evenly over the first ``num_types`` of TYPES (or over ``types``), 8
    per node."""
    types = types or TYPES[:num_types]
    per_type = num_devices // len(types)
    nodes, racks = [], {}
    for t, (device, price) in enumerate(types):
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
    raw = {"name": f"synthetic-{num_devices}x{len(types)}", "nodes": nodes, "tiers": tiers}
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


_HOMOGENEOUS: dict[tuple, float] = {}


def homogeneous_fraction(num_devices: int, device: str, model_name: str, global_batch: int,
                         seq_len: int) -> float:
    """The fraction of the aggregate bound the search reaches on ``num_devices`` devices of one
    type, shaped as the synthetic clusters (0 when nothing fits); cached per case."""
    key = (num_devices, device, model_name, global_batch, seq_len)
    if key not in _HOMOGENEOUS:
        price = dict(TYPES).get(device, 1.0)
        cluster, model = synthetic_cluster(num_devices, 1, [(device, price)]), get_model(model_name)
        cost = CatalogCostSource.for_cluster(model, cluster)
        try:
            result = search(cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1,
                            baselines=False)
            _HOMOGENEOUS[key] = result.best.tokens_per_s / result.aggregate_tokens_per_s
        except MedleyInputError:
            _HOMOGENEOUS[key] = 0.0
    return _HOMOGENEOUS[key]


def heterogeneity(cluster: Cluster, model_name: str, global_batch: int, seq_len: int, cost,
                  fraction: float) -> dict:
    """Issue 27's heterogeneity efficiency: the plan's fraction of the aggregate bound over the
    weighted fraction the same search reaches on homogeneous clusters of each type with as many
    devices as the mixed cluster and the same samples per device (weights: each type's share of
    the mixed cluster's aggregate bound)."""
    model = get_model(model_name)
    by_type = cluster.devices_by_type()
    sizes = tuple(s for s in MICRO_BATCH_SIZES if global_batch % s == 0)
    bounds = {t: aggregate_bound(cluster, model, cost, seq_len=seq_len, micro_batch_sizes=sizes, devices=ids)
              for t, ids in by_type.items()}
    total = sum(bounds.values())
    per_device = global_batch // cluster.num_devices
    by = {t: {"weight": bounds[t] / total,
              "homogeneous_fraction": homogeneous_fraction(cluster.num_devices, t, model_name,
                                                           per_device * cluster.num_devices, seq_len)}
          for t in by_type}
    reference = sum(v["weight"] * v["homogeneous_fraction"] for v in by.values())
    return {"by_type": by, "reference": reference, "efficiency": fraction / reference if reference else None}


def cluster_of(source: str) -> Cluster:
    """``synthetic:N`` (:func:`synthetic_cluster` of N devices) or a cluster TOML path."""
    if source.startswith("synthetic:"):
        size = int(source.split(":", 1)[1])
        return synthetic_cluster(size, SIZES[size])
    return parse_cluster_arg(source)


def cost_of(cluster: Cluster, model, profiles: str | None):
    """The catalog estimate, or the Metis-format profiles of directory ``profiles`` (catalog for the
    rest)."""
    catalog = CatalogCostSource.for_cluster(model, cluster)
    if profiles is None:
        return catalog
    return MetisCostSource.from_directory(Path(profiles), model, fallback=catalog)


def _timed_search(source: str, model_name: str, global_batch: int, seq_len: int,
                  profiles: str | None = None) -> float:
    """CPU seconds of one search (baselines excluded) in this process, inputs built untimed."""
    cluster, model = cluster_of(source), get_model(model_name)
    cost = cost_of(cluster, model, profiles)
    start = time.process_time()
    try:
        search(cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1, baselines=False)
    except MedleyInputError:
        pass
    return time.process_time() - start


def search_cpu_runs(source: str, model_name: str, global_batch: int, seq_len: int, runs: int,
                    profiles: str | None = None) -> list[float]:
    """CPU seconds of ``runs`` searches, each in a fresh spawned process (cold caches, as a
    ``medley plan`` run; never forked: the parent has run torch ops)."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1, maxtasksperchild=1) as pool:
        return [pool.apply(_timed_search, (source, model_name, global_batch, seq_len, profiles))
                for _ in range(runs)]


def large_case(timing_runs: int) -> dict:
    """Issue 14's headline goal: LLaMA-2-70B on examples/large-1024.toml at 1,024 sequences of
    4,096 tokens, the best plan's fraction of the aggregate bound and the search's CPU time."""
    source, model_name = str(ROOT / "examples" / "large-1024.toml"), "llama-2-70b"
    global_batch, seq_len = 1024, 4096
    cluster, model = cluster_of(source), get_model(model_name)
    cost = CatalogCostSource.for_cluster(model, cluster)
    start = time.process_time()
    result = search(cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1,
                    baselines=False)
    in_bench = time.process_time() - start
    runs = search_cpu_runs(source, model_name, global_batch, seq_len, timing_runs) if timing_runs else []
    best = result.best
    prediction = best.prediction
    fraction = best.tokens_per_s / result.aggregate_tokens_per_s
    used = set(best.plan.devices)
    idle = {t: len([d for d in ids if d not in used]) for t, ids in cluster.devices_by_type().items()}
    return {
        "cluster": "examples/large-1024.toml",
        "devices": cluster.num_devices,
        "model": model_name,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "tokens_per_s": best.tokens_per_s,
        "aggregate_tokens_per_s": result.aggregate_tokens_per_s,
        "aggregate_fraction": fraction,
        "plan": shape(best),
        "asymmetric": best.plan.asymmetric,
        "devices_used": len(used),
        "idle_by_type": {t: n for t, n in idle.items() if n},
        "stage_types": [[t for t, _ in groupby(cluster.devices[d].type.name for d in g.assignment[0])]
                        for g in best.plan.groups],
        "recomputing_stages": sum(sum(map(bool, g.recompute)) for g in best.plan.groups),
        "recompute_modes": sorted({str(r) for g in best.plan.groups for r in g.recompute}),
        "heterogeneity": heterogeneity(cluster, model_name, global_batch, seq_len, cost, fraction),
        "bubble_fraction": prediction.bubble_fraction,
        "exposed_comm_s": prediction.exposed_comm_s,
        "step_time_s": prediction.step_time_s,
        "search_cpu_in_bench_s": in_bench,
        "search_cpu_runs": runs,
        "search_cpu_s": min(runs) if runs else in_bench,
    }


def search_case(
    num_devices: int, model_name: str, *, singles: bool, ablation: bool, timing_runs: int = 0,
    heterogeneity_rows: bool = True,
) -> dict:
    cluster = cluster_of(f"synthetic:{num_devices}")
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
    sizes = tuple(s for s in MICRO_BATCH_SIZES if global_batch % s == 0)
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
    if timing_runs:  # the machine is shared: the least of fresh runs is the search's own time
        runs = search_cpu_runs(f"synthetic:{num_devices}", model_name, global_batch, seq_len, timing_runs)
        row.update(search_cpu_in_bench_s=row["search_cpu_s"], search_cpu_runs=runs, search_cpu_s=min(runs))
    best = result.best
    row.update(
        tokens_per_s=best.tokens_per_s,
        step_time_s=best.prediction.step_time_s,
        plan=shape(best),
        simulated=len(result.simulated),
        structures=result.structures_estimated,
        aggregate_fraction=best.tokens_per_s / result.aggregate_tokens_per_s,
        devices_used=len(best.plan.devices),
        asymmetric=best.plan.asymmetric,
        used_fraction=used_fraction(best, cost, seq_len, sizes),
    )
    if SIZES[num_devices] > 1 and heterogeneity_rows:
        row["heterogeneity"] = heterogeneity(cluster, model_name, global_batch, seq_len, cost,
                                             row["aggregate_fraction"])
    estimator = Estimator(
        cluster, model, cost, seq_len=seq_len, global_batch=global_batch, memory_headroom=0.05
    )
    t0 = time.perf_counter()
    result.baselines = run_baselines(estimator, list(range(cluster.num_devices)), sizes, Constraints())
    row["baselines_wall_s"] = time.perf_counter() - t0
    row["baselines"] = {n: (None if b is None else shape(b)) for n, b in result.baselines.items()}
    row["versus"] = {
        n: (None if b is None else best.tokens_per_s / b.tokens_per_s) for n, b in result.baselines.items()
    }
    found = [b.tokens_per_s for b in result.baselines.values() if b is not None]
    row["versus_best_baseline"] = best.tokens_per_s / max(found) if found else None
    row["baselines_used_fraction"] = {
        n: None if b is None else used_fraction(b, cost, seq_len, sizes) for n, b in result.baselines.items()
    }
    if ablation:
        t0 = time.perf_counter()
        row["ablation"] = ablation_row(ablate(result))
        row["ablation_wall_s"] = time.perf_counter() - t0
    if singles:
        single, name = _single_type_best(cluster, model, global_batch, seq_len, cost)
        row["best_single_type"] = name
        row["versus_best_single_type"] = best.tokens_per_s / single if single else None
    return row


def used_fraction(plan, cost, seq_len: int, sizes: tuple[int, ...]) -> float:
    """The plan's tokens/s as a fraction of the aggregate bound of the devices it uses (what it
    leaves idle does not count against it)."""
    bound = aggregate_bound(plan.plan.cluster, plan.plan.shared.model, cost, seq_len=seq_len,
                            micro_batch_sizes=sizes, devices=plan.plan.devices)
    return plan.tokens_per_s / bound


def shape(plan) -> str:
    """Pool, pp x dp (tp where not 1), schedule and micro-batch size of a ranked plan; each
    replica group's, joined by ' + ', for replica groups of their own shape."""
    candidate = plan.candidate
    parts = getattr(candidate, "parts", None) or (candidate,)
    shapes = []
    for part, layout in zip(parts, plan.plan.groups, strict=True):
        tp = "" if all(t == 1 for t in layout.tp) else f" tp={','.join(map(str, layout.tp))}"
        shapes.append(f"{part.structure.pool} pp={layout.pp} dp={layout.dp}{tp} {layout.schedule}")
    return " + ".join(shapes) + f" mbs={plan.plan.shared.micro_batch_size}"


def ablation_row(ablation) -> dict:
    return {
        "best_baseline": ablation.baseline,
        "best_baseline_step_time_s": ablation.baseline_step_s,
        "steps": {
            step.name: {
                "step_time_s": step.step_time_s,
                "share_of_gain": step.share_of_gain,
                "plan": None if step.plan is None else shape(step.plan),
                "note": step.note,
            }
            for step in ablation.steps
        },
    }


PROFILE_CASES = [  # (cluster, model, profile directory): A100-40GB + V100-16GB, measured layers
    (f"{n}xA100-40GB+{n}xV100-16GB", model, profiles)
    for n in (8, 32)
    for model, profiles in (("opt-350m", str(PROFILES)), ("gpt-neo-2.7b", str(ROOT / "bench" / "data" /
                                                                                 "metis-gpt-neo-2.7")))
]


def profile_case(source: str, model_name: str, profiles: str, timing_runs: int) -> dict:
    """A search driven by measured per-layer profiles (Metis format, the public sets), 8 sequences
    of 2,048 tokens per device: its time (the least of fresh runs) and its best plan."""
    cluster, model = cluster_of(source), get_model(model_name)
    global_batch, seq_len = 8 * cluster.num_devices, 2048
    cost = cost_of(cluster, model, profiles)
    start = time.process_time()
    result = search(cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1,
                    baselines=False)
    in_bench = time.process_time() - start
    runs = (search_cpu_runs(source, model_name, global_batch, seq_len, timing_runs, profiles)
            if timing_runs else [])
    best = result.best
    return {
        "cluster": source, "devices": cluster.num_devices, "model": model_name,
        "profiles": str(Path(profiles).relative_to(ROOT)), "global_batch": global_batch, "seq_len": seq_len,
        "tokens_per_s": best.tokens_per_s, "plan": shape(best), "asymmetric": best.plan.asymmetric,
        "devices_used": len(best.plan.devices),
        "aggregate_fraction": best.tokens_per_s / result.aggregate_tokens_per_s,
        "search_cpu_in_bench_s": in_bench, "search_cpu_runs": runs,
        "search_cpu_s": min(runs) if runs else in_bench,
    }


def pruning_cases() -> list[tuple[str, Cluster, str, int, str]]:
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


def pruning_case(
    label: str, cluster: Cluster, model_name: str, global_batch: int, source: str, *, budget_s: float
) -> dict:
    model = get_model(model_name)
    seq_len = 2048
    catalog = CatalogCostSource.for_cluster(model, cluster)
    cost = MetisCostSource.from_directory(PROFILES, model, fallback=catalog) if source == "metis" else catalog
    wall = time.perf_counter()
    result = search(
        cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, top=1, baselines=False
    )
    planner_s = time.perf_counter() - wall
    reference = reference_search(
        cluster, model, global_batch=global_batch, seq_len=seq_len, cost=cost, budget_s=budget_s
    )
    found = reference.best.tokens_per_s if reference.best is not None else 0.0
    return {
        "case": label,
        "model": model_name,
        "global_batch": global_batch,
        "costs": source,
        "planner_tokens_per_s": result.best.tokens_per_s,
        "planner_plan": shape(result.best),
        "planner_wall_s": planner_s,
        "planner_simulated": len(result.simulated),
        "reference_tokens_per_s": found,
        "reference_plan": None if reference.best is None else shape(reference.best),
        "reference_estimated": reference.estimated,
        "reference_simulated": reference.simulated,
        "reference_enumerated_seeds": reference.enumerated,
        "reference_complete": reference.complete,
        "reference_wall_s": reference.seconds,
        "loss_from_pruning": 1.0 - result.best.tokens_per_s / found if found else None,
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
    found = {n: b.tokens_per_s for n, b in result.baselines.items() if b is not None}
    return {
        "case": label,
        "model": model_name,
        "samples_per_device": per_device,
        "global_batch": global_batch,
        "tokens_per_s": result.best.tokens_per_s,
        "aggregate_tokens_per_s": result.aggregate_tokens_per_s,
        "aggregate_fraction": result.best.tokens_per_s / result.aggregate_tokens_per_s,
        "versus_best_baseline": result.best.tokens_per_s / max(found.values()) if found else None,
        "best_baseline": max(found, key=lambda n: found[n]) if found else None,
        "best_plan": shape(result.best),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="search,large,profiles,pruning,bound")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--singles-up-to",
        type=int,
        default=256,
        help="compare with the best single-type plan on clusters up to this size",
    )
    parser.add_argument(
        "--ablation-up-to", type=int, default=256, help="run the ablation on clusters up to this size"
    )
    parser.add_argument(
        "--reference-budget", type=float, default=300.0, help="seconds of reference search per pruning case"
    )
    parser.add_argument(
        "--timing-runs", type=int, default=3,
        help="searches timed, each in a fresh process; a row's search time is the least (0: the bench's own)",
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
    # The former "gap" section enumerated structure x family only (one split and one memory option
    # per pair): the pruning section replaces it.
    data.pop("gap", None)
    data.get("provenance", {}).pop("gap", None)
    # Sections not run now keep their rows and the provenance they were measured with.
    data["provenance"] = {**data.get("provenance", {}), **{s: provenance() for s in sections}}
    if "search" in sections:
        # Rows of other sizes and models keep their figures (and their own provenance, if any).
        rows = {(r["devices"], r["model"]): r for r in data.get("search", [])}
        for size in map(int, args.sizes.split(",")):
            for model in args.models.split(","):
                row = search_case(
                    size, model, singles=size <= args.singles_up_to, ablation=size <= args.ablation_up_to,
                    timing_runs=args.timing_runs,
                )
                row["provenance"] = provenance()
                print(json.dumps(row), flush=True)
                rows[(size, model)] = row
        data["search"] = sorted(rows.values(), key=lambda r: (r["devices"], MODELS.index(r["model"])
                                                               if r["model"] in MODELS else len(MODELS)))
    if "large" in sections:
        data["large"] = large_case(args.timing_runs)
        print(json.dumps(data["large"]), flush=True)
    if "profiles" in sections:
        data["profiles"] = []
        for case in PROFILE_CASES:
            row = profile_case(*case, timing_runs=args.timing_runs)
            print(json.dumps(row), flush=True)
            data["profiles"].append(row)
    if "pruning" in sections:
        data["pruning"] = []
        for case in pruning_cases():
            row = pruning_case(*case, budget_s=args.reference_budget)
            print(json.dumps(row), flush=True)
            data["pruning"].append(row)
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
