"""``medley simulate``: time one plan, described inline by flags, on a cluster."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from medley.cli.console import make_console, print_table, styled
from medley.cli.options import inline_options
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import CostSource
from medley.cost.user_profiles import PerDeviceCostSource, measured_cost_source
from medley.errors import MedleyInputError
from medley.fileio import check_output_file
from medley.lowering.predict import layer_sources, simulate_layout
from medley.plan.inline import InlineFlags, layout_of
from medley.plan.layout import PlanLayout
from medley.plan.world import build_world
from medley.sim.problem import SimProblem
from medley.sim.result import SimResult
from medley.spec.catalog import precision_reason
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

GB = 1e9
PROFILE_HELP = "A `medley profile` file; repeat it, one per device type (the catalog answers the others)"
COMM_PROFILE_HELP = "Measured links (`medley profile --comm`) in place of the cluster file's nominal ones"
PROFILES_HELP = "Directory of Metis-format profiles (DeviceType.A100_tp1_bs1.json, or A100-40/mbs1_tmp1.json)"
GANTT_SUFFIXES = (".png", ".svg", ".pdf")
SIZE_FLAGS = "--dp, --micro-batches, --zero, --buckets, --gather-windows"  # what sizes a simulated step
MERGE_ABOVE = 64  # devices; beyond, the per-device table merges devices with equal figures
MAX_ROWS = 64  # rows of the merged table shown (the first and the last)


def group_summary(layout: PlanLayout) -> dict:
    """One replica group's shape, as plain data."""
    return {
        "schedule": layout.schedule,
        "knobs": dict(layout.knobs),
        "pp": layout.pp,
        "dp": layout.dp,
        "tp": [layout.tp_of(k) for k in range(layout.pp)],
        "sequence_parallel": layout.sequence_parallel,
        # tp_groups[k][r]: the devices of replica r's pipeline rank k, TP rank order
        "tp_groups": [[list(layout.group(r, k)) for r in range(layout.dp)] for k in range(layout.pp)],
        "split": list(layout.stage_layers),
        "micro_batches": list(layout.micro_batches),
        "zero": [z.level for z in layout.zero],
        "recompute": [bool(r) for r in layout.recompute],
        "recompute_mode": [str(r) for r in layout.recompute],
    }


def summary(layout: PlanLayout | Sequence[PlanLayout], cluster: Cluster, problem: SimProblem,
            result: SimResult) -> dict:
    """The figures the table shows, as plain data for ``--json``: a layout, or the replica groups
    of one plan (``replica_groups``: each group's shape; ``segments``: what their replicas
    synchronise, :mod:`medley.plan.segments`)."""
    groups = (layout,) if isinstance(layout, PlanLayout) else tuple(layout)
    first = groups[0]
    replicas = [(group, r, g) for g, group in enumerate(groups) for r in range(group.dp)]
    stages, group_of = {}, {}
    for replica, (group, r, g) in enumerate(replicas):
        s2r = problem.schedules[replica].stage_to_rank
        for rank in range(group.pp):
            for d in group.group(r, rank):
                stages[d] = [s for s, k in enumerate(s2r) if k == rank]
                group_of[d] = g
    devices = []
    for report in result.devices:
        device = cluster.devices[report.device]
        capacity = device.type.memory_bytes
        devices.append(
            {
                "device": report.device,
                "type": device.type.name,
                "node": device.node,
                "group": group_of[report.device],
                "replica": report.replica,
                "rank": report.rank,
                "tp": report.tp,
                "tp_rank": report.tp_rank,
                "stages": stages[report.device],
                "busy": report.busy_fraction,
                "idle": report.idle_fraction,
                "bubble": report.bubble_fraction,
                # the step's parts on this device (seconds; they sum to step_time_s)
                **{f"{part}_s": seconds for part, seconds in report.parts.items()},
                "static_memory_gb": report.static_memory_bytes / GB,
                "peak_memory_gb": report.peak_memory_bytes / GB,
                "capacity_gb": capacity / GB,
                "headroom_gb": (capacity - report.peak_memory_bytes) / GB,
                "fits": report.peak_memory_bytes <= capacity,
            }
        )
    out: dict = {
        "model": first.model.name,
        "micro_batch_size": first.micro_batch_size,
        "seq_len": first.seq_len,
        "dtype": first.dtype,
        "precision": precision_reason(first.dtype,
                                      cluster.device_types(d for g in groups for d in g.devices).values()),
        "zero_placement": str(first.placement),
        "replica_groups": [group_summary(group) for group in groups],
        "step_time_s": result.step_time_s,
        "tokens_per_s": result.tokens_per_s,
        "mfu": result.mfu,
        "bubble_fraction": result.bubble_fraction,
        "fits": all(d["fits"] for d in devices),
        "devices": devices,
    }
    if len(groups) == 1:  # alike replicas: the group's shape is the plan's, and each stage its segment
        out.update(group_summary(first))
        out["stages"] = [
            {"stage": s, "level": first.zero[s].level, "layers": first.stage_layers[s],
             "zero_comm_s": z.comm_s, "exposed_s": z.exposed_s}
            for s, z in sorted(result.zero.items())
        ]
    else:
        world = build_world(groups)
        out["segments"] = [
            {"layers": [segment.first, segment.stop - 1], "level": segment.zero.level,
             "buckets": len(segment.buckets), "tp": segment.tp,
             "holders": [[h.group, h.replica, h.stage] for h in segment.holders]}
            for segment in world.segments.segments
        ]
    return out


def _title(data: dict) -> str:
    if "schedule" not in data:
        return (f"{data['model']} · {len(data['replica_groups'])} replica groups of their own shape · ZeRO "
                f"placement {data['zero_placement']}")
    tp = f" tp={','.join(map(str, data['tp']))}" if any(t > 1 for t in data.get("tp", ())) else ""
    tp += "+sp" if tp and data.get("sequence_parallel") else ""
    return (f"{data['model']} · {data['schedule']} · pp={data['pp']} dp={data['dp']}{tp} "
            f"· split {data['split']} · ZeRO {data['zero']} ({data['zero_placement']}) · {data['dtype']}")


def print_groups(data: dict, console: Console) -> None:
    """One row per replica group of an asymmetric plan: its shape and devices."""
    table = Table(title="replica groups (each replica holds every layer; replicas meet in the ZeRO "
                  "groups of the sync segments)")
    for col in ("group", "replicas", "pp", "tp", "schedule", "split", "micro-batches", "ZeRO", "devices"):
        table.add_column(col, justify="right")
    for g, group in enumerate(data["replica_groups"]):
        devices = sorted(d for rank in group["tp_groups"] for replica in rank for d in replica)
        knobs = "".join(f" {k}={v}" for k, v in group["knobs"].items())
        table.add_row(str(g), str(group["dp"]), str(group["pp"]), ",".join(map(str, group["tp"])),
                      group["schedule"] + knobs, ",".join(map(str, group["split"])),
                      ",".join(map(str, group["micro_batches"])), ",".join(map(str, group["zero"])),
                      _span(devices) if devices == list(range(devices[0], devices[-1] + 1)) else
                      ",".join(map(str, devices)))
    print_table(console, table)
    segments = data.get("segments", [])
    if segments:
        console.print("sync segments: " + "; ".join(
            _layers(*s["layers"]) + f" ZeRO-{s['level']} over {len(s['holders'])} replicas"
            for s in segments))


def print_summary(data: dict, console: Console) -> None:
    if "schedule" not in data:
        print_groups(data, console)
    table = Table(
        title=_title(data),
        caption="transfer, ZeRO, CLIP: idle while that communication runs and blocks the device (exposed); "
        "CLIP wait: at the gradient-norm all-reduce for the other ranks; bubble: for other devices",
    )
    for col in (
        "device",
        "type",
        "replica/rank",
        "stages",
        "busy",
        "bubble",
        "transfer",
        "ZeRO",
        "CLIP",
        "CLIP wait",
        "peak mem",
        "headroom",
    ):
        table.add_column(col, justify="right")
    for row in device_rows(data["devices"], grouped="schedule" not in data):
        table.add_row(*row)
    print_table(console, table)
    if data.get("stages"):
        zt = Table(title="ZeRO communication per stage (worst device of the stage; exposed <= collective)")
        for col in ("stage", "level", "layers", "collective time", "exposed"):
            zt.add_column(col, justify="right")
        for s in data["stages"]:
            zt.add_row(
                str(s["stage"]),
                str(s["level"]),
                str(s["layers"]),
                f"{s['zero_comm_s'] * 1e3:.1f} ms",
                f"{s['exposed_s'] * 1e3:.1f} ms",
            )
        print_table(console, zt)
    if "tp_groups" in data and any(t > 1 for t in data.get("tp", ())):
        console.print("tensor parallel: " + "; ".join(
            f"rank {k} tp {t}" + (" on " + ", ".join(_span(g) for g in groups) if t > 1 else "")
            for k, (t, groups) in enumerate(zip(data["tp"], data["tp_groups"], strict=True))))
    if any(data.get("recompute", ())):
        console.print("recomputation per stage: " + ", ".join(data["recompute_mode"]))
    console.print("precision: " + data["precision"])
    if "cost_sources" in data:
        parts = [f"{device}: " + ", ".join(f"{kind} {src}" for kind, src in kinds.items())
                 for device, kinds in data["cost_sources"].items()]
        console.print("layer times from " + "; ".join(parts))
    verdict = (
        styled("fits in memory on every device", "")
        if data["fits"] else styled("does NOT fit in memory (see OOM rows)", "red")
    )
    console.print(Text.assemble(
        f"step {data['step_time_s']:.3f} s · {data['tokens_per_s']:,.0f} tokens/s · MFU {data['mfu']:.1%} · "
        f"bubble {data['bubble_fraction']:.1%} · ", verdict))


def _layers(first: int, last: int) -> str:
    return f"layers {first}-{last}" if last > first else f"layer {first}"


def _device_cells(d: dict, *, grouped: bool) -> list[str]:
    """One device's row: device, type, (replica group and) replica, rank (and TP rank), then its
    figures."""
    headroom = f"{d['headroom_gb']:.1f} GB" + ("" if d["fits"] else " OOM")
    return [
        str(d["device"]),
        d["type"],
        f"g{d['group']} " if grouped else "",
        str(d["replica"]),
        f"{d['rank']}" + (f" tp{d['tp_rank']}/{d['tp']}" if d.get("tp", 1) > 1 else ""),
        ",".join(map(str, d["stages"])),
        f"{d['busy']:.1%}",
        f"{d['bubble']:.1%}",
        f"{d['exposed_transfer_s'] * 1e3:.1f} ms",
        f"{d['exposed_zero_s'] * 1e3:.1f} ms",
        f"{d['exposed_clip_s'] * 1e3:.1f} ms",
        f"{d['clip_barrier_s'] * 1e3:.1f} ms",
        f"{d['peak_memory_gb']:.1f} GB",
        headroom,
    ]


def device_rows(devices: list[dict], *, grouped: bool = False) -> list[list[str]]:
    """The per-device table's rows (``grouped``: replicas named with their group, ``g1 0/2``): one
    per device up to :data:`MERGE_ABOVE` devices; beyond, the devices whose every printed figure
    is equal share a row (their ids and replicas as ranges), and of more than :data:`MAX_ROWS` such
    rows the first and the last are shown, with one row saying how many are left out (``--json``
    lists every device). Work and output grow at most linearly."""
    cells = [_device_cells(d, grouped=grouped) for d in devices]
    if len(cells) <= MERGE_ABOVE:
        return [[c[0], c[1], f"{c[2]}{c[3]}/{c[4]}", *c[5:]] for c in cells]
    groups: dict[tuple[str, ...], tuple[list[int], list[int]]] = {}
    for d, c in zip(devices, cells, strict=True):
        ids, replicas = groups.setdefault((c[1], c[2], *c[4:]), ([], []))
        ids.append(d["device"])
        replicas.append(d["replica"])
    rows = [[ranges(ids), key[0], f"{key[1]}{ranges(replicas)}/{key[2]}", *key[3:]]
            for key, (ids, replicas) in groups.items()]
    if len(rows) <= MAX_ROWS:
        return rows
    head, tail = rows[:MAX_ROWS - 16], rows[-16:]
    hidden = rows[len(head):-16]
    oom = sum(row[-1].endswith("OOM") for row in hidden)
    note = f"{len(hidden):,} more rows" + (f" ({oom:,} OOM)" if oom else "") + "; --json lists every device"
    return [*head, ["...", note, *[""] * (len(head[0]) - 2)], *tail]


def ranges(values: list[int], *, width: int = 40) -> str:
    """Sorted ``values`` as ranges (``0-3,8,10-12``); past ``width`` characters, the first ones and
    the count (``0,2,4,... (3,125)``)."""
    parts: list[str] = []
    ordered = sorted(values)
    start = prev = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    text = ",".join(parts)
    if len(text) <= width:
        return text
    return text[:width].rsplit(",", 1)[0] + f",... ({len(ordered):,})"


def _span(devices: list[int]) -> str:
    """A TP group's devices: ``4-5`` (consecutive ids)."""
    return f"{devices[0]}-{devices[-1]}" if len(devices) > 1 else str(devices[0])


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    @inline_options()
    def simulate_cmd(
        cluster: Annotated[
            str, typer.Option(help="Cluster TOML file, or a catalog device with a count: 8xA100-80GB")
        ],
        model: Annotated[str, typer.Option(help="Preset, Hugging Face config.json or model directory")],
        no_comm: Annotated[
            bool, typer.Option("--no-comm", help="Transfers and collectives take no time")
        ] = False,
        trace: Annotated[Path | None, typer.Option(help="Write a Chrome trace (Perfetto) here")] = None,
        gantt: Annotated[Path | None, typer.Option(help="Write a Gantt chart PNG here")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON")] = False,
        profile: Annotated[list[Path] | None, typer.Option(help=PROFILE_HELP)] = None,
        profiles: Annotated[Path | None, typer.Option(help=PROFILES_HELP)] = None,
        comm_profile: Annotated[Path | None, typer.Option(help=COMM_PROFILE_HELP)] = None,
        dtype: Annotated[
            str | None,
            typer.Option(help="bf16, fp16 or fp32 (default: the profiles', else bf16 where supported)"),
        ] = None,
        *,
        inline: InlineFlags,  # the inline plan's flags (inline_options)
    ) -> None:
        """Simulate one training step of a plan and report time, bubbles and memory per device."""
        check_pictures(trace=trace, gantt=gantt)
        spec = with_comm_profile(parse_cluster_arg(cluster), comm_profile)
        model_spec = get_model(model)
        seq_len = inline.sequence_length(model_spec)
        cost = cost_source(model_spec, spec, profiles=profile or (), profiles_dir=profiles, dtype=dtype,
                           seq_len=seq_len)
        if dtype is None and isinstance(cost, PerDeviceCostSource):
            dtype = cost.profile_dtype
        layout = layout_of(inline, cluster=spec, model=model_spec, cost=cost, dtype=dtype)
        problem, result = simulate_layout(layout, spec, cost=cost, comm=not no_comm, where=SIZE_FLAGS)
        write_pictures(result, trace=trace, gantt=gantt, cluster=spec)
        data = summary(layout, spec, problem, result)
        data["cost_sources"] = layer_sources(layout, spec, cost)
        if as_json:
            typer.echo(json.dumps(data, indent=2))
        else:
            print_summary(data, make_console())


def cost_source(
    model: ModelSpec, cluster: Cluster, *, profiles: Sequence[Path] = (), profiles_dir: Path | None = None,
    dtype: str | None = None, seq_len: int | None = None,
) -> CostSource:
    """The catalog estimate, with the device types that ``--profile`` files (one per type) or a
    ``--profiles`` directory of Metis-format files measured answered from them (every profile must
    match a type of ``cluster``: medley.cost.user_profiles). ``seq_len`` is assumed for Metis
    files that do not record theirs. What a ``--profiles`` directory held for types the cluster
    lacks is left out and named in one line on stderr."""
    catalog = CatalogCostSource.for_cluster(model, cluster, dtype=dtype or "bf16")
    notes: list[str] = []
    source = measured_cost_source(catalog, cluster, profiles=profiles, profiles_dir=profiles_dir,
                                  seq_len=seq_len, notes=notes)
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    return source


def with_comm_profile(cluster: Cluster, path: Path | None) -> Cluster:
    """``cluster`` with the links a ``--comm-profile`` file measured (medley.cost.comm_profile)."""
    if path is None:
        return cluster
    from medley.cost.comm_profile import apply_comm_profile, load_comm_profile

    return apply_comm_profile(cluster, load_comm_profile(path), path=path)


def check_pictures(*, trace: Path | None, gantt: Path | None) -> None:
    """Before any work: ``--trace`` and ``--gantt`` can be written (a file path in a writable place;
    the chart a .png, .svg or .pdf, since matplotlib would otherwise append .png to the name)."""
    if trace is not None:
        check_output_file(trace, flag="--trace")
    if gantt is not None:
        check_output_file(gantt, flag="--gantt")
        if gantt.suffix.lower() not in GANTT_SUFFIXES:
            raise MedleyInputError(f"--gantt {gantt}: give a file name ending in .png (or .svg, .pdf), "
                                   f"e.g. {gantt.with_name(gantt.name + '.png')}")


def write_pictures(result: SimResult, *, trace: Path | None, gantt: Path | None,
                   roles: dict[int, str] | None = None, cluster: Cluster | None = None) -> None:
    """The Chrome trace and the Gantt chart of ``result``; ``roles``: each device's part of the plan
    (:func:`medley.plan.world.device_roles`), shown beside its name; ``cluster``: the one simulated,
    whose device types name the chart's rows."""
    if trace is not None:
        from medley.sim.trace import write_chrome_trace

        write_chrome_trace(result, trace, roles=roles)
    if gantt is not None:
        from medley.sim.gantt import write_gantt

        write_gantt(result, gantt, roles=roles, cluster=cluster)
