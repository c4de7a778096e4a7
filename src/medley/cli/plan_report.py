"""A search's figures as data (``medley plan --json``) and as the tables ``medley plan`` and the
demo print."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from medley.cli.console import print_table
from medley.cli.simulate_cmd import group_summary
from medley.cost.recompute import recompute_mark
from medley.lowering.predict import layer_sources
from medley.plan.layout import PlanLayout
from medley.search.planner import SearchResult
from medley.search.rank.ranking import RankedPlan
from medley.search.report.ablation import Ablation
from medley.spec.catalog import precision_reason
from medley.spec.cluster import Cluster

GB = 1e9
BASELINE_DEVICES = 64
"""Largest cluster whose plan runs the baselines by default: on 64 devices they add about 11 s to
a 3 s search, on 1,024 devices many minutes."""


def group_row(layout: PlanLayout, cluster: Cluster) -> dict:
    """One replica group's shape as data (a plan of alike replicas is one group)."""
    return {
        **group_summary(layout),
        "device_types": sorted({cluster.devices[d].type.name for d in layout.devices}),
        "devices_used": len(layout.devices),
        "dtype": layout.dtype,
        "micro_batch_size": layout.micro_batch_size,
        "streamed": [z.streams for z in layout.zero],
        "placement": layout.placement.value,
    }


def _shape_fields(plan: RankedPlan, cluster: Cluster) -> dict:
    """The plan's shape: its groups (``replica_groups``) and, for alike replicas, the one group's
    fields at the top level too."""
    groups = [group_row(layout, cluster) for layout in plan.plan.groups]
    dtype = plan.plan.shared.dtype  # one precision for every group
    precision = precision_reason(dtype, cluster.device_types(plan.plan.devices).values())
    return {"asymmetric": plan.plan.asymmetric, "devices_used": len(plan.plan.devices),
            "precision": precision, "replica_groups": groups, **({} if plan.plan.asymmetric else groups[0])}


def _plan_row(plan: RankedPlan, result: SearchResult) -> dict:
    pred, cluster = plan.prediction, result.cluster
    headroom: dict[str, float] = {}
    for report in plan.result.devices:
        device = cluster.devices[report.device]
        free = (device.type.memory_bytes - report.peak_memory_bytes) / GB
        headroom[device.type.name] = min(headroom.get(device.type.name, free), free)
    versus = {
        name: (None if b is None else plan.tokens_per_s / b.tokens_per_s)
        for name, b in result.baselines.items()
    }
    return {
        "tokens_per_s": pred.tokens_per_s,
        "step_time_s": pred.step_time_s,
        "bubble_fraction": pred.bubble_fraction,
        "exposed_comm_s": pred.exposed_comm_s,
        "mfu": pred.mfu,
        "cost_per_mtoken_usd": plan.cost_per_mtoken,
        "headroom_gb_by_type": headroom,
        "versus_baselines": versus,
        "aggregate_fraction": pred.tokens_per_s / result.aggregate_tokens_per_s,
        **_shape_fields(plan, cluster),
        "cost_source": pred.cost_source,
        # per device type and layer kind
        "cost_sources": layer_sources(plan.plan.groups, cluster, result.cost),
    }


def _baseline_row(plan: RankedPlan, result: SearchResult) -> dict:
    """A baseline's simulated figures and the shape its system gave it."""
    return {"tokens_per_s": plan.tokens_per_s, "step_time_s": plan.prediction.step_time_s,
            **_shape_fields(plan, result.cluster)}


def _shape(plan: RankedPlan) -> str:
    return " + ".join(_group_shape(layout) for layout in plan.plan.groups)


def _group_shape(layout: PlanLayout) -> str:
    tp = _tp_text([layout.tp_of(k) for k in range(layout.pp)])
    sp = "+sp" if tp and layout.sequence_parallel else ""  # sequence parallelism on the TP stages
    return f"pp={layout.pp} dp={layout.dp}{tp}{sp} {layout.schedule}"


def _tp_text(tp: list[int]) -> str:
    """`` tp=2`` / `` tp=2,1`` (run-length as the other per-stage columns), empty when all are 1."""
    return "" if set(tp) <= {1} else f" tp={_short(tp)}"


def ablation_data(ablation: Ablation) -> dict:
    """The ablation's figures: each constrained search's step time and share of the gain."""
    return {
        "best_step_time_s": ablation.best_step_s,
        "best_baseline": ablation.baseline,
        "best_baseline_step_time_s": ablation.baseline_step_s,
        "steps": [
            {
                "without": step.name,
                "removed": step.removed,
                "step_time_s": step.step_time_s,
                "share_of_gain": step.share_of_gain,
                "note": step.note,
                "plan": None if step.plan is None else _shape(step.plan),
            }
            for step in ablation.steps
        ],
    }


def result_data(result: SearchResult) -> dict:
    baselines = {
        name: None if b is None else _baseline_row(b, result) for name, b in result.baselines.items()
    }
    return {
        "model": result.model.name,
        "cluster": result.cluster.name,
        "global_batch": result.global_batch,
        "seq_len": result.seq_len,
        "objective": result.objective,
        "aggregate_bound_tokens_per_s": result.aggregate_tokens_per_s,
        "plans": [_plan_row(p, result) for p in result.plans],
        "baselines": baselines,
        "simulated": len(result.simulated),
        "structures": result.structures_estimated,
    }


def _short(values: list) -> str:
    """The values in full, comma-separated (a table never cuts a number)."""
    return ",".join(map(str, values))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_result(data: dict, console: Console) -> None:
    """Two tables: the simulated figures of each ranked plan, then what each plan is."""
    names = list(data["baselines"])
    figures = Table(
        title=f"{data['model']} on {data['cluster']} · global batch {data['global_batch']} x "
        f"{data['seq_len']} tokens · ranked by {data['objective']} (every figure simulated)"
    )
    columns = ["#", "tokens/s", "step", "bubble", "exposed comm", "headroom GB by type"]
    columns += [*(f"vs {n}" for n in names), "of bound"]
    if data["objective"] == "cost":
        columns.insert(2, "$/Mtok")
    for col in columns:
        figures.add_column(col, justify="right")
    shapes = Table(title="The ranked plans")
    columns = ("#", "pp x dp", "tp per rank", "schedule", "mbs x counts", "layers per stage",
               "ZeRO per stage", "dtype")
    for col in columns:
        shapes.add_column(col, justify="right", overflow="fold")
    for rank, row in enumerate(data["plans"], 1):
        _add_figures(figures, rank, row, names, data["objective"])
        groups = row["replica_groups"]
        for g, group in enumerate(groups):
            _add_shape(shapes, f"{rank}" if len(groups) == 1 else f"{rank}.g{g}", group)
    print_table(console, figures)
    print_table(console, shapes)
    console.print(f"precision of plan 1: {data['plans'][0]['precision']} "
                  "(medley train --dtype trains another)")
    if any(row["asymmetric"] for row in data["plans"]):
        console.print("N.gK: replica group K of plan N, replicas of their own shape (each holds every layer; "
                      "replicas meet in the ZeRO groups of the layers they share)")
    _print_baselines(data, console)


def _add_figures(figures: Table, rank: int, row: dict, names: list[str], objective: str) -> None:
    cells = [
        str(rank),
        f"{row['tokens_per_s']:,.0f}",
        f"{row['step_time_s']:.3f} s",
        f"{row['bubble_fraction']:.1%}",
        f"{row['exposed_comm_s'] * 1e3:.0f} ms",
        " ".join(f"{t}:{g:.1f}" for t, g in row["headroom_gb_by_type"].items()),
        *(_ratio(row["versus_baselines"][n]) for n in names),
        f"{row['aggregate_fraction']:.0%}",
    ]
    if objective == "cost":
        cells.insert(2, f"{row['cost_per_mtoken_usd']:.3f}")
    figures.add_row(*cells)


def _add_shape(shapes: Table, label: str, row: dict) -> None:
    zero = ["3s" if s else str(z) for z, s in zip(row["zero"], row["streamed"], strict=True)]
    modes = row.get("recompute_mode") or ["full" if rc else "none" for rc in row["recompute"]]
    zero = [z + recompute_mark(mode) for z, mode in zip(zero, modes, strict=True)]
    knobs = "".join(f" {k}={v}" for k, v in row["knobs"].items())
    shapes.add_row(
        label,
        f"{row['pp']} x {row['dp']}",
        _short(row["tp"]),
        row["schedule"] + knobs,
        f"{row['micro_batch_size']} x {_short(sorted(set(row['micro_batches'])))}",
        _short(row["split"]),
        _short(zero),
        row["dtype"],
    )


def _print_baselines(data: dict, console: Console) -> None:
    if not data["baselines"]:
        console.print(f"baselines not run (default above {BASELINE_DEVICES} devices, minutes each); "
                      "--baselines runs them")
    for name, b in data["baselines"].items():
        text = "no plan fits"
        if b is not None:
            tp = _tp_text(b["tp"])
            text = (
                f"{b['tokens_per_s']:,.0f} tokens/s ({b['step_time_s']:.3f} s, pp={b['pp']} dp={b['dp']}{tp} "
                f"{b['schedule']} on {'+'.join(b['device_types'])})"
            )
        console.print(f"baseline {name}: {text}")
    console.print(
        f"aggregate bound: {data['aggregate_bound_tokens_per_s']:,.0f} tokens/s · {data['simulated']} plans "
        f"simulated exactly out of {data['structures']} structures · ZeRO: level per stage, 3s = streamed "
        "ZeRO-3, r = full recomputation, s = selective, :K on the first K blocks"
    )
    if "ablation" in data:
        print_ablation(data["ablation"], console)


def print_ablation(ablation: dict, console: Console) -> None:
    """One line per constrained search: its step time and its share of the gain."""
    base = ablation["best_baseline"]
    gain = (
        f"over {base} ({ablation['best_baseline_step_time_s']:.3f} s)" if base else "(no baseline fits)"
    )
    best = ablation["best_step_time_s"]
    console.print(f"ablation: best plan {best:.3f} s; where its gain {gain} comes from (each alone):")
    for step in ablation["steps"]:
        seconds = "no plan fits" if step["step_time_s"] is None else f"{step['step_time_s']:.3f} s"
        note = f" ({step['note']})" if step["note"] else ""
        console.print(f"  without {step['without']} ({step['removed']}): {seconds}"
                      f"{share_words(step['share_of_gain'], step['step_time_s'], best, base)}{note}")


def share_words(share: float | None, seconds: float | None, best: float, base: str | None) -> str:
    """A step's share of the gain in words: a share in [0, 1] as a percentage; above 1 (the search
    without the freedom is slower than the best baseline) and below 0 (faster than the best plan:
    the planner's pruning missed that plan) as what they mean, not as 939% or -5%."""
    if share is None or seconds is None:
        return ""
    if share > 1:
        return f", {seconds / best:.2f}x the best plan's step: slower than {base} without it"
    if share < 0:
        return (f", {1 - seconds / best:.1%} faster than the best plan: a plan the planner's pruning "
                "missed")
    return f", {share:.0%} of the gain"
