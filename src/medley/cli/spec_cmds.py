"""`medley devices`, `medley cluster show`, `medley model show`: what the specs say and what layers cost.

The print_* and *_summary functions are reused by the demo and by scripts (`--json`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from medley.cli.console import make_console, print_table
from medley.cli.error_exit import MedleyInputError
from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Pass
from medley.spec.catalog import DeviceType, load_catalog
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model import PRESETS, ModelSpec
from medley.spec.model_arg import get_model

DEFAULT_MODEL_CLUSTER = "4xA100-80GB+4xV100-32GB+4xT4-16GB"  # the demo cluster's device types
ADAM_BYTES_PER_PARAM = 16  # bf16 weight + bf16 grad + fp32 master, m, v


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:,.1f} MiB"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"


# `medley devices`: one line per type in 80 columns (header, cells); --wide adds memory bandwidth.
COMPACT_DEVICE_COLUMNS = ("name", "mem GB", "half TF", "fp32 TF", "bf16", "link GB/s", "conf")
WIDE_DEVICE_COLUMNS = ("name", "bf16/fp16 TF", "fp32 TF", "memory GB", "mem BW GB/s", "intra-node link",
                       "bf16", "confidence")
LEFT_DEVICE_COLUMNS = ("name", "link GB/s", "intra-node link", "conf", "confidence")


def print_devices(catalog: dict[str, DeviceType], console: Console, *, wide: bool = False) -> None:
    """The catalog, one row per type: name, memory, dense peaks, bf16, link, confidence (fits 80
    columns); ``wide`` spells the headers out and adds memory bandwidth."""
    if wide:
        title = f"Device catalog ({len(catalog)} types; dense peaks)"
        columns = WIDE_DEVICE_COLUMNS
    else:
        title = f"Device catalog ({len(catalog)} types; dense peaks; half = bf16/fp16; --wide for more)"
        columns = COMPACT_DEVICE_COLUMNS
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in LEFT_DEVICE_COLUMNS else "right")
    for d in catalog.values():
        link = f"{d.intra_node_link} {d.intra_node_bandwidth_gbps:g}"
        bf16 = "yes" if d.supports_bf16 else "no"
        half, fp32, memory = f"{d.peak_tflops_half:g}", f"{d.peak_tflops_fp32:g}", f"{d.memory_gb:g}"
        if wide:
            bandwidth = f"{d.memory_bandwidth_gbps:g}"
            table.add_row(d.name, half, fp32, memory, bandwidth, link, bf16, d.confidence)
        else:
            table.add_row(d.name, memory, half, fp32, bf16, link, d.confidence)
    print_table(console, table)


def cluster_summary(cluster: Cluster) -> dict[str, Any]:
    nodes = []
    for node in cluster.nodes:
        types = {cluster.devices[i].type.name for i in node.device_ids}
        nodes.append(
            {
                "name": node.name,
                "device_types": sorted(types),
                "count": len(node.device_ids),
                "first_device": node.device_ids[0],
                "groups": list(node.groups),
                "memory_gb": sum(cluster.devices[i].type.memory_gb for i in node.device_ids),
                "tflops": sum(cluster.devices[i].type.peak_tflops_half for i in node.device_ids),
                "link": {
                    "kind": node.link.kind,
                    "bandwidth_gbps": node.link.bandwidth_gbps,
                    "latency_us": node.link.latency_us,
                },
            }
        )
    tiers = [
        {
            "name": t.name,
            "bandwidth_gbps": t.bandwidth_gbps,
            "latency_us": t.latency_us,
            "groups": {g: list(m) for g, m in t.groups.items()},
            "pairs": [
                {"between": sorted(k), "bandwidth_gbps": v[0], "latency_us": v[1]} for k, v in t.pairs.items()
            ],
        }
        for t in cluster.tiers
    ]
    by_type = {name: len(ids) for name, ids in cluster.devices_by_type().items()}
    return {
        "name": cluster.name,
        "num_devices": cluster.num_devices,
        "devices_by_type": by_type,
        "total_tflops_half": cluster.total_tflops(),
        "total_memory_gb": cluster.total_memory_gb(),
        "nodes": nodes,
        "tiers": tiers,
    }


def tflops_text(tflops: float) -> str:
    """Whole TFLOPS from 10 up, two significant digits below (a CPU's 0.5 is not "0")."""
    return f"{tflops:,.0f}" if tflops >= 10 else f"{tflops:.2g}"


def print_cluster(cluster: Cluster, console: Console) -> None:
    summary = cluster_summary(cluster)
    table = Table(
        title=f"Cluster '{cluster.name}': {cluster.num_devices} devices, "
        f"{tflops_text(summary['total_tflops_half'])} bf16/fp16 TFLOPS, "
        f"{summary['total_memory_gb']:,.0f} GB"
    )
    for col in ("node", "devices", "ids", "memory GB", "TFLOPS", "node link", "groups"):
        table.add_column(col, justify="right" if col in ("memory GB", "TFLOPS") else "left")
    rows = summary["nodes"]
    shown = rows if len(rows) <= 24 else rows[:12] + rows[-4:]
    for row in shown:
        last = row['first_device'] + row['count'] - 1
        ids = f"{row['first_device']}" if last == row['first_device'] else f"{row['first_device']}-{last}"
        link = (
            f"{row['link']['kind']} {row['link']['bandwidth_gbps']:g} GB/s, {row['link']['latency_us']:g} µs"
        )
        table.add_row(
            row["name"],
            f"{row['count']}x {', '.join(row['device_types'])}",
            ids,
            f"{row['memory_gb']:,.0f}",
            tflops_text(row["tflops"]),
            link,
            " / ".join(row["groups"]),
        )
    if len(shown) < len(rows):
        table.add_row("...", f"({len(rows) - len(shown)} more nodes)", "", "", "", "", "")
    print_table(console, table)
    tiers = Table(title="Network tiers (innermost first; bandwidth per node, per direction)")
    for col in ("tier", "bandwidth GB/s", "latency µs", "groups", "pair overrides"):
        tiers.add_column(col)
    for t in summary["tiers"]:
        tiers.add_row(
            t["name"],
            f"{t['bandwidth_gbps']:g}",
            f"{t['latency_us']:g}",
            str(len(t["groups"])),
            str(len(t["pairs"])),
        )
    if summary["tiers"]:
        print_table(console, tiers)


def preset_rows() -> list[dict[str, Any]]:
    """Every model preset's name and shape (what ``--model NAME`` takes)."""
    return [{"name": name, "params": formulas.total_params(spec), "blocks": spec.num_blocks,
             "hidden": spec.hidden_size, "heads": spec.num_heads, "kv_heads": spec.num_kv_heads,
             "vocab": spec.vocab_size, "max_seq_len": spec.max_seq_len,
             "tied_embeddings": spec.tied_embeddings}
            for name, spec in PRESETS.items()]


def print_presets(console: Console) -> None:
    table = Table(title="Model presets (--model NAME; or a Hugging Face config.json or model directory)")
    for col in ("name", "parameters", "blocks", "hidden", "heads / kv", "vocab", "max seq"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for row in preset_rows():
        params = row["params"]
        size = f"{params / 1e9:.1f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
        table.add_row(row["name"], size, str(row["blocks"]), str(row["hidden"]),
                      f"{row['heads']} / {row['kv_heads']}", f"{row['vocab']:,}", f"{row['max_seq_len']:,}")
    print_table(console, table)


def model_summary(
    model: ModelSpec, cluster: Cluster, *, micro_batch_size: int, seq_len: int, dtype: str = "bf16"
) -> dict[str, Any]:
    """Per layer kind: params, FLOPs, activation bytes, and F/B/W seconds per device type."""
    if micro_batch_size <= 0 or seq_len <= 0:
        raise MedleyInputError("--micro-batch-size and --seq-len must be positive integers.")
    model.check_seq_len(seq_len)
    shape = {"micro_batch_size": micro_batch_size, "seq_len": seq_len}
    source = CatalogCostSource.for_cluster(model, cluster, dtype=dtype)
    d = 4 if dtype == "fp32" else 2
    groups = [
        ("embedding", [0]),
        ("block", list(range(1, model.num_blocks + 1))),
        ("head", [model.num_layers - 1]),
    ]
    layers = []
    for kind, indices in groups:
        i = indices[0]
        layers.append(
            {
                "kind": kind,
                "first": indices[0],
                "last": indices[-1],
                "count": len(indices),
                "params": formulas.layer_params(model, i),
                "held_params": formulas.layer_held_params(model, i),
                "flops": {p.value: formulas.layer_flops(model, i, p, **shape) for p in Pass},
                "activation_bytes": formulas.layer_activation_bytes(model, i, dtype_bytes=d, **shape),
                "activation_bytes_recompute": formulas.layer_activation_bytes(
                    model, i, dtype_bytes=d, recompute=True, **shape
                ),
                "activation_bytes_after_b": formulas.layer_activation_bytes_after_b(
                    model, i, dtype_bytes=d, **shape
                ),
                "seconds": {
                    t: {p.value: source.layer_time(i, p, device_type=t, **shape).seconds for p in Pass}
                    for t in cluster.device_types()
                },
            }
        )
    return {
        "model": {k: getattr(model, k) for k in model.__dataclass_fields__},
        "dtype": dtype,
        **shape,
        "total_params": formulas.total_params(model),
        "num_layers": model.num_layers,
        "boundary_bytes": formulas.boundary_bytes(model, dtype_bytes=d, **shape),
        "layers": layers,
        "cost_source": "catalog",
    }


def print_model_costs(
    model: ModelSpec,
    cluster: Cluster,
    *,
    micro_batch_size: int,
    seq_len: int,
    console: Console,
    dtype: str = "bf16",
) -> None:
    s = model_summary(model, cluster, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype)
    title = (
        f"{model.name}: {_count(s['total_params'])} params, {model.num_layers} layers; micro-batch "
        f"{micro_batch_size} x {seq_len} tokens, {dtype}; stage boundary {_gib(s['boundary_bytes'])}"
    )
    table = Table(title=title)
    for col in ("layer", "params", "F/B/W GFLOP", "activations", "recompute", "after B", "weights+Adam"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for row in s["layers"]:
        span = f"{row['first']}" if row["count"] == 1 else f"{row['first']}-{row['last']}"
        flops = "/".join(f"{row['flops'][p.value] / 1e9:,.1f}" for p in Pass)
        table.add_row(
            f"{row['kind']} {span}" + (" (each)" if row["count"] > 1 else ""),
            _count(row["params"]),
            flops,
            _gib(row["activation_bytes"]),
            _gib(row["activation_bytes_recompute"]),
            _gib(row["activation_bytes_after_b"]),
            _gib(row["held_params"] * ADAM_BYTES_PER_PARAM),
        )
    print_table(console, table)
    times = Table(title="Estimated ms per layer and micro-batch (catalog peaks)")
    for col in ("device type", "pass", *(row["kind"] for row in s["layers"]), "whole model"):
        times.add_column(col, justify="left" if col in ("device type", "pass") else "right")
    for device_type in cluster.device_types():
        for p in Pass:
            cells = [f"{row['seconds'][device_type][p.value] * 1e3:,.3f}" for row in s["layers"]]
            total = sum(row["count"] * row["seconds"][device_type][p.value] for row in s["layers"])
            times.add_row(device_type if p is Pass.F else "", p.value, *cells, f"{total * 1e3:,.1f}")
    print_table(console, times)


def register(app: typer.Typer) -> None:
    cluster_app = typer.Typer(no_args_is_help=True, help="Inspect cluster files.")
    model_app = typer.Typer(no_args_is_help=True, help="Inspect models and their per-layer costs.")
    app.add_typer(cluster_app, name="cluster")
    app.add_typer(model_app, name="model")

    @app.command()
    def devices(
        catalog: Annotated[Path | None, typer.Option(help="TOML file adding or overriding entries")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
        wide: Annotated[bool, typer.Option("--wide", help="full headers and memory bandwidth (about 110 "
                                                          "columns)")] = False,
    ) -> None:
        """The device catalog: dense peak TFLOPS, memory, bandwidth, links."""
        entries = load_catalog(catalog)
        if as_json:
            typer.echo(
                json.dumps(
                    [{k: getattr(d, k) for k in d.__dataclass_fields__} for d in entries.values()], indent=2
                )
            )
        else:
            print_devices(entries, make_console(), wide=wide)

    @cluster_app.command("show")
    def cluster_show(
        cluster: Annotated[str, typer.Argument(help="cluster TOML file, or a short form like 8xA100-80GB")],
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    ) -> None:
        """Devices, memory, aggregate TFLOPS and link tiers of a cluster."""
        spec = parse_cluster_arg(cluster)
        if as_json:
            typer.echo(json.dumps(cluster_summary(spec), indent=2))
        else:
            print_cluster(spec, make_console())

    @model_app.command("list")
    def model_list(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
        """The model presets: name, parameters and shape."""
        if as_json:
            typer.echo(json.dumps(preset_rows(), indent=2))
        else:
            print_presets(make_console())

    @model_app.command("show")
    def model_show(
        model: Annotated[str, typer.Argument(help="preset name or path of a Hugging Face config.json")],
        cluster: Annotated[str, typer.Option(help="cluster file or short form: whose device types")] = (
            DEFAULT_MODEL_CLUSTER
        ),
        micro_batch_size: Annotated[int, typer.Option(min=1, help="sequences per micro-batch")] = 1,
        seq_len: Annotated[
            int | None, typer.Option(min=1, help="tokens per sequence (default: the model's maximum)")
        ] = None,
        dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    ) -> None:
        """Parameters, per-layer FLOPs, memory, and F/B/W time on each device type of a cluster."""
        spec = get_model(model)
        shape = {"micro_batch_size": micro_batch_size, "seq_len": seq_len or spec.max_seq_len, "dtype": dtype}
        if as_json:
            typer.echo(json.dumps(model_summary(spec, parse_cluster_arg(cluster), **shape), indent=2))
        else:
            print_model_costs(spec, parse_cluster_arg(cluster), console=make_console(), **shape)
