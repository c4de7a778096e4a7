"""medley's predictions against published GPU training measurements.

Run: .venv/bin/python bench/published.py   (writes bench/results/published.{json,md}; the JSON
records the commit and command, the Markdown is written from it)
     .venv/bin/python bench/published.py --rows ID,ID --no-write   (a few rows, printed)

Each row of bench/published_runs.toml is a published training configuration with its source and
its measured throughput. The bench builds that configuration as ``medley simulate`` does (a
cluster of the row's nodes and network, :func:`medley.plan.inline.inline_layout`, the catalog cost
source, :func:`medley.lowering.predict.simulate_layout`) and compares the simulated tokens/s with the
measured. The rows are split in two halves named in the data file (``half``): the catalog's
calibration (per-type fields of src/medley/spec/devices.toml with a ``calibration`` note) was
fitted on the ``calibration`` half only; the ``held_out`` half is reported apart.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from provenance import provenance

from medley.cost.estimator import CatalogCostSource
from medley.lowering.predict import simulate_layout
from medley.plan.inline import inline_layout
from medley.spec.catalog import catalog_entry, get_device_type
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "published_runs.toml"
RESULTS = ROOT / "bench" / "results"
HALVES = ("calibration", "held_out")


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One published row, as read from the data file.

    Attributes:
        id: the row's name.
        source: key of its [sources] entry.
        model: the model's shape.
        gpu: catalog device type (or one of the file's ``device_types``).
        gpus: devices of the job.
        gpus_per_node: devices per node.
        inter_node_gbit_per_gpu: network between nodes, Gb/s per GPU (None: one node).
        tp, pp, dp: parallel degrees (dp = gpus / (tp x pp)).
        virtual_stages: chunks per pipeline rank (1: plain 1F1B).
        micro_batch_size: sequences per micro-batch.
        global_batch: sequences per optimizer step.
        seq_len: tokens per sequence.
        recompute: none, full or selective.
        precision: bf16 or fp16.
        zero: ZeRO level of every stage.
        measured_tokens_per_s: the measured throughput of the whole job, tokens/s.
        half: calibration or held_out.
        vocab_parallel_head: the source's framework splits the head over the vocabulary under TP.
        features: labels the bench groups errors by.
    """

    id: str
    source: str
    model: ModelSpec
    gpu: str
    gpus: int
    gpus_per_node: int
    inter_node_gbit_per_gpu: float | None
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    micro_batch_size: int
    global_batch: int
    seq_len: int
    recompute: str
    precision: str
    zero: int
    measured_tokens_per_s: float
    half: str
    vocab_parallel_head: bool
    features: tuple[str, ...]


def narayanan_flops_per_step(model: ModelSpec, *, global_batch: int, seq_len: int) -> float:
    """Narayanan et al. 2021, Eq. 3: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per step (with the
    recomputation forward), the count their Table 1's teraFLOP/s use."""
    b, s, lay, h, v = global_batch, seq_len, model.num_blocks, model.hidden_size, model.vocab_size
    return 96.0 * b * s * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))


def _model(name: str, raw: dict, seq_len: int) -> ModelSpec:
    return ModelSpec(
        name=name, vocab_size=raw["vocab"], hidden_size=raw["hidden"], num_blocks=raw["blocks"],
        num_heads=raw["heads"], num_kv_heads=raw["kv_heads"], ffn_hidden_size=raw["ffn"], mlp=raw["mlp"],
        norm=raw["norm"], position=raw["position"], max_seq_len=seq_len, tied_embeddings=raw["tied"],
        bias=raw["bias"])


def _measured(row: dict, model: ModelSpec) -> float:
    measured = row["measured"]
    if "tokens_per_s" in measured:
        return float(measured["tokens_per_s"])
    if measured.get("flops") != "narayanan2021":
        raise ValueError(f"run {row['id']}: measured needs tokens_per_s or tflops_per_gpu with flops")
    per_step = narayanan_flops_per_step(model, global_batch=row["global_batch"], seq_len=row["seq_len"])
    step_s = per_step / (measured["tflops_per_gpu"] * 1e12 * row["gpus"])
    return row["global_batch"] * row["seq_len"] / step_s


def _features(row: dict) -> tuple[str, ...]:
    out = [f"zero{row['zero']}" if row["zero"] >= 2 else "ddp"]
    if row["tp"] > 1:
        out.append("tp")
    if row["pp"] > 1:
        out.append("pp")
    if row.get("virtual_stages", 1) > 1:
        out.append("interleaved")
    out.append(f"recompute-{row['recompute']}")
    out.append("multi-node" if row["gpus"] > row["gpus_per_node"] else "one-node")
    return tuple(out)


def load_runs(path: Path = DATA) -> tuple[list[Run], dict]:
    """The data file's runs, and the file itself (sources and device types)."""
    data = tomllib.loads(path.read_text())
    runs = []
    for row in data["runs"]:
        model = _model(row["model"], data["models"][row["model"]], row["seq_len"])
        dp = row["gpus"] // (row["tp"] * row["pp"])
        if dp * row["tp"] * row["pp"] != row["gpus"] or row["global_batch"] % (dp * row["micro_batch_size"]):
            raise ValueError(f"run {row['id']}: gpus, tp, pp, micro-batch and global batch disagree")
        if row["half"] not in HALVES or row["source"] not in data["sources"]:
            raise ValueError(f"run {row['id']}: half must be one of {HALVES} and source a [sources] key")
        runs.append(Run(
            id=row["id"], source=row["source"], model=model, gpu=row["gpu"], gpus=row["gpus"],
            gpus_per_node=row["gpus_per_node"], inter_node_gbit_per_gpu=row.get("inter_node_gbit_per_gpu"),
            tp=row["tp"], pp=row["pp"], dp=dp, virtual_stages=row.get("virtual_stages", 1),
            micro_batch_size=row["micro_batch_size"], global_batch=row["global_batch"],
            seq_len=row["seq_len"], recompute=row["recompute"], precision=row["precision"],
            zero=row["zero"], measured_tokens_per_s=_measured(row, model), half=row["half"],
            vocab_parallel_head=data["sources"][row["source"]].get("vocab_parallel_head", False),
            features=_features(row)))
    return runs, data


def base_type(gpu: str, device_types: dict) -> str:
    """The catalog type a row's GPU is, or is derived from (a data file ``device_types`` entry's
    ``base``): the type whose calibration it uses."""
    return device_types[gpu]["base"] if gpu in device_types else get_device_type(gpu).name


def cluster_for(run: Run, device_types: dict, overrides: dict | None = None) -> Cluster:
    """The row's cluster: ``gpus / gpus_per_node`` nodes of the row's device (NVLink inside, the
    catalog's figures) joined by one network tier of the row's per-GPU bandwidth. A GPU the data
    file defines is its ``base`` catalog entry with the file's fields; ``overrides`` (catalog
    fields per base type, for the calibration fit) replace the catalog's."""
    nodes = run.gpus // run.gpus_per_node
    raw: dict = {"name": run.id, "nodes": [{"name": "node", "device": run.gpu, "count": run.gpus_per_node,
                                            "repeat": nodes}]}
    base = base_type(run.gpu, device_types)
    extra = (overrides or {}).get(base, {})
    if run.gpu in device_types:
        fields = {k: v for k, v in device_types[run.gpu].items() if k != "base"}
        raw["device_types"] = {run.gpu: {**catalog_entry(get_device_type(base)), **fields, **extra}}
    elif extra:
        raw["device_types"] = {run.gpu: extra}
    if nodes > 1:
        if run.inter_node_gbit_per_gpu is None:
            raise ValueError(f"run {run.id}: several nodes need inter_node_gbit_per_gpu")
        raw["tiers"] = [{"name": "network", "bandwidth_gbit": run.inter_node_gbit_per_gpu * run.gpus_per_node,
                         "latency_us": 10.0}]
    return cluster_from_dict(raw, source=f"{DATA.name}: run {run.id}")


def predict(run: Run, device_types: dict, overrides: dict | None = None) -> dict:
    """Simulate the row's configuration as ``medley simulate`` would; its figures and the ratio
    (``overrides``: catalog fields per base type, :func:`cluster_for`)."""
    cluster = cluster_for(run, device_types, overrides)
    cost = CatalogCostSource.for_cluster(run.model, cluster, dtype=run.precision,
                                         vocab_parallel=run.vocab_parallel_head)
    micro_batches = run.global_batch // (run.dp * run.micro_batch_size)
    interleaved = run.virtual_stages > 1
    started = time.perf_counter()
    layout = inline_layout(
        cluster=cluster, model=run.model, cost=cost, pp=run.pp, dp=run.dp,
        schedule="interleaved" if interleaved else "1f1b", micro_batches=str(micro_batches),
        micro_batch_size=run.micro_batch_size, seq_len=run.seq_len, virtual_stages=run.virtual_stages,
        zero=str(run.zero), buckets=max(1, run.model.num_blocks // (run.pp * run.virtual_stages)),
        gather_windows=0 if run.zero == 3 else 1, recompute_mode=run.recompute, dtype=run.precision,
        tp=str(run.tp), sequence_parallel=False)
    _, result = simulate_layout(layout, cluster, cost=cost)
    ratio = result.tokens_per_s / run.measured_tokens_per_s
    return {
        "id": run.id, "source": run.source, "half": run.half, "gpu": run.gpu, "gpus": run.gpus,
        "model": run.model.name, "tp": run.tp, "pp": run.pp, "dp": run.dp, "zero": run.zero,
        "micro_batch_size": run.micro_batch_size, "micro_batches": micro_batches, "seq_len": run.seq_len,
        "recompute": run.recompute, "features": list(run.features),
        "measured_tokens_per_s": run.measured_tokens_per_s, "predicted_tokens_per_s": result.tokens_per_s,
        "ratio": ratio, "error": ratio - 1.0, "predicted_mfu": result.mfu,
        "fits": all(d.peak_memory_bytes <= cluster.devices[d.device].type.memory_bytes
                    for d in result.devices),
        "sim_s": time.perf_counter() - started,
    }


def stats(rows: list[dict]) -> dict:
    """Median and worst |error|, geo-mean ratio (bias) and how many rows are optimistic."""
    if not rows:
        return {"rows": 0}
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {
        "rows": len(rows),
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": abs(worst["error"]),
        "worst_row": worst["id"],
        "geo_mean_ratio": math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows)),
        "optimistic": sum(r["ratio"] > 1 for r in rows),
    }


def summarise(rows: list[dict]) -> dict:
    """Figures per half, per GPU type, per source and per feature."""
    groups: dict[str, dict] = {"all": stats(rows)}
    groups["by_half"] = {h: stats([r for r in rows if r["half"] == h]) for h in HALVES}
    for key in ("gpu", "source"):
        values = sorted({r[key] for r in rows})
        groups[f"by_{key}"] = {v: stats([r for r in rows if r[key] == v]) for v in values}
    features = sorted({f for r in rows for f in r["features"]})
    groups["by_feature"] = {f: stats([r for r in rows if f in r["features"]]) for f in features}
    return groups


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _stat_line(s: dict) -> str:
    if not s.get("rows"):
        return "| 0 | | | | |"
    return (f"| {s['rows']} | {s['median_abs_error']:.1%} | {s['worst_abs_error']:.1%} ({s['worst_row']}) | "
            f"{s['geo_mean_ratio']:.3f} | {s['optimistic']} of {s['rows']} |")


def _half_line(s: dict) -> str:
    if not s.get("rows"):
        return "no rows"
    return (f"{s['rows']} rows, median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} "
            f"({s['worst_row']}), geo-mean predicted/measured {s['geo_mean_ratio']:.3f}")


def markdown(result: dict) -> str:
    """The Markdown report, every figure from ``result``."""
    summary, rows = result["summary"], result["rows"]
    held, cal = summary["by_half"]["held_out"], summary["by_half"]["calibration"]
    lines = [
        "# Predictions against published GPU measurements",
        "",
        f"Commit `{result['commit']}`, command `{result['command']}`. Data: `bench/published_runs.toml` "
        f"({summary['all']['rows']} rows, {len(result['sources'])} sources, "
        f"{len(summary['by_gpu'])} GPU types); catalog calibration: per-type fields of "
        "`src/medley/spec/devices.toml`, fitted on the calibration half only (`bench/published_fit.py`).",
        "",
        f"**Held-out half: {_half_line(held)}.** Calibration half: {_half_line(cal)}.",
        "",
        "| group | rows | median abs error | worst abs error | geo-mean ratio | optimistic |",
        "|---|---|---|---|---|---|",
        "| all " + _stat_line(summary["all"]),
    ]
    for section in ("by_half", "by_gpu", "by_source", "by_feature"):
        for name, s in summary[section].items():
            lines.append(f"| {section[3:]}: {name} " + _stat_line(s))
    lines += ["", "| run | half | GPU | GPUs | tp/pp/dp | ZeRO | mbs x m | seq | recompute | "
              "measured tok/s | predicted tok/s | ratio | fits |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['id']} | {r['half']} | {r['gpu']} | {r['gpus']} | {r['tp']}/{r['pp']}/{r['dp']} | "
            f"{r['zero']} | "
            f"{r['micro_batch_size']} x {r['micro_batches']} | {r['seq_len']} | {r['recompute']} | "
            f"{r['measured_tokens_per_s']:,.0f} | {r['predicted_tokens_per_s']:,.0f} | {r['ratio']:.3f} | "
            f"{'yes' if r['fits'] else 'NO'} |")
    lines += ["", "Sources:", ""]
    lines += [f"- `{key}`: {src['cite']}; configuration: {src['config']}; hardware: {src['hardware']}"
              for key, src in result["sources"].items()]
    lines += ["", "Ratio = predicted / measured tokens/s (> 1: medley is optimistic). 'fits': the simulated "
              "peak memory is within the device's memory on every device.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", help="comma-separated run ids (default: every row)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write bench/results/")
    args = parser.parse_args(argv)
    runs, data = load_runs()
    if args.rows:
        wanted = set(args.rows.split(","))
        runs = [r for r in runs if r.id in wanted]
    rows = []
    for run in runs:
        row = predict(run, data.get("device_types", {}))
        rows.append(row)
        print(f"{row['id']:32s} {row['half']:11s} measured {row['measured_tokens_per_s']:>12,.0f} "
              f"predicted {row['predicted_tokens_per_s']:>12,.0f} ratio {row['ratio']:.3f} "
              f"({row['sim_s']:.1f} s)", flush=True)
    result = {**provenance(), "sources": data["sources"], "summary": summarise(rows), "rows": rows}
    held = result["summary"]["by_half"]["held_out"]
    if held.get("rows"):
        print(f"held-out: median |error| {held['median_abs_error']:.1%}, "
              f"worst {held['worst_abs_error']:.1%}, "
              f"geo-mean ratio {held['geo_mean_ratio']:.3f}")
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "published.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "published.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
