"""``medley plan``: search the best plans for a model on a cluster; ``medley show``: render a plan file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from medley.cli.console import make_console, print_table
from medley.cli.errors import MedleyInputError
from medley.cli.progress import PhaseBar
from medley.cli.simulate_cmd import (
    COMM_PROFILE_HELP,
    PROFILE_HELP,
    PROFILES_HELP,
    check_pictures,
    cost_source,
    print_summary,
    summary,
    with_comm_profile,
    write_pictures,
)
from medley.fileio import check_output_dir, check_output_file
from medley.plan.ablation import Ablation, ablate
from medley.plan.inline import parse_int_list
from medley.plan.plan import load_plan, save_plan
from medley.plan.predict import layer_sources, predict
from medley.plan.ranking import RankedPlan
from medley.plan.search import SearchResult, search
from medley.plan.space import SEARCHED_FAMILIES, Constraints
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

GB = 1e9


def _plan_row(plan: RankedPlan, result: SearchResult) -> dict:
    layout, pred, cluster = plan.plan.layout, plan.prediction, result.cluster
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
        "schedule": layout.schedule,
        "knobs": dict(layout.knobs),
        "pp": layout.pp,
        "dp": layout.dp,
        "tp": [layout.tp_of(k) for k in range(layout.pp)],
        "devices_used": len(layout.devices),
        "micro_batch_size": layout.micro_batch_size,
        "micro_batches": list(layout.micro_batches),
        "split": list(layout.stage_layers),
        "zero": [z.level for z in layout.zero],
        "streamed": [z.streams for z in layout.zero],
        "recompute": list(layout.recompute),
        "cost_source": pred.cost_source,
        "cost_sources": layer_sources(layout, cluster, result.cost),  # per device type and layer kind
    }


def _baseline_row(plan: RankedPlan, result: SearchResult) -> dict:
    """A baseline's simulated figures and the shape its system gave it."""
    layout, cluster = plan.plan.layout, result.cluster
    return {
        "tokens_per_s": plan.tokens_per_s,
        "step_time_s": plan.prediction.step_time_s,
        "pp": layout.pp,
        "dp": layout.dp,
        "tp": [layout.tp_of(k) for k in range(layout.pp)],
        "schedule": layout.schedule,
        "knobs": dict(layout.knobs),
        "device_types": sorted({cluster.devices[d].type.name for row in layout.assignment for d in row}),
        "devices_used": len(layout.devices),
        "micro_batch_size": layout.micro_batch_size,
        "micro_batches": list(layout.micro_batches),
        "split": list(layout.stage_layers),
        "zero": [z.level for z in layout.zero],
        "recompute": list(layout.recompute),
        "placement": layout.placement.value,
    }


def _shape(plan: RankedPlan) -> str:
    layout = plan.plan.layout
    tp = _tp_text([layout.tp_of(k) for k in range(layout.pp)])
    return f"pp={layout.pp} dp={layout.dp}{tp} {layout.schedule}"


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
               "ZeRO per stage")
    for col in columns:
        shapes.add_column(col, justify="right", overflow="fold")
    for rank, row in enumerate(data["plans"], 1):
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
        if data["objective"] == "cost":
            cells.insert(2, f"{row['cost_per_mtoken_usd']:.3f}")
        figures.add_row(*cells)
        zero = ["3s" if s else str(z) for z, s in zip(row["zero"], row["streamed"], strict=True)]
        zero = [z + ("r" if rc else "") for z, rc in zip(zero, row["recompute"], strict=True)]
        knobs = "".join(f" {k}={v}" for k, v in row["knobs"].items())
        shapes.add_row(
            str(rank),
            f"{row['pp']} x {row['dp']}",
            _short(row["tp"]),
            row["schedule"] + knobs,
            f"{row['micro_batch_size']} x {_short(sorted(set(row['micro_batches'])))}",
            _short(row["split"]),
            _short(zero),
        )
    print_table(console, figures)
    print_table(console, shapes)
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
        "ZeRO-3, r = recomputation"
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
        share = "" if step["share_of_gain"] is None else f", {step['share_of_gain']:.0%} of the gain"
        note = f" ({step['note']})" if step["note"] else ""
        console.print(f"  without {step['without']} ({step['removed']}): {seconds}{share}{note}")


def _constraints(
    max_pp, schedules, memory_headroom, exclude_devices, micro_batch_sizes, cluster
) -> Constraints:
    families = tuple(s.strip() for s in schedules.split(",") if s.strip()) if schedules else None
    excluded = ()
    if exclude_devices:
        try:
            excluded = tuple(sorted({int(x) for x in exclude_devices.split(",") if x.strip()}))
        except ValueError:
            raise MedleyInputError(
                f"--exclude-devices '{exclude_devices}': give device ids separated by commas, like 0,1,7"
            ) from None
    sizes = None
    if micro_batch_sizes:
        count = len(micro_batch_sizes.split(","))
        sizes = parse_int_list(micro_batch_sizes, flag="--micro-batch-sizes", count=count, minimum=1)
    base = Constraints()
    del cluster
    return Constraints(
        max_pp=max_pp,
        schedules=families or base.schedules,
        memory_headroom=memory_headroom,
        exclude_devices=excluded,
        micro_batch_sizes=sizes,
    )


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_cmd(
        cluster: Annotated[
            str, typer.Option(help="Cluster TOML file, or a short form like 8xA100-40GB+8xV100-16GB")
        ],
        model: Annotated[str, typer.Option(help="Preset, Hugging Face config.json or model directory")],
        global_batch: Annotated[int, typer.Option(min=1, help="Sequences per optimizer step")] = 512,
        seq_len: Annotated[int, typer.Option(min=1, help="Tokens per sequence")] = 2048,
        objective: Annotated[
            str, typer.Option(help="throughput, or cost (needs price_per_hour)")
        ] = "throughput",
        top: Annotated[int, typer.Option(help="How many ranked plans to show")] = 5,
        out: Annotated[Path | None, typer.Option(help="Write the best plan here (TOML)")] = None,
        explain: Annotated[bool, typer.Option("--explain", help="Say why the best plan wins")] = False,
        export: Annotated[
            tuple[str, Path] | None, typer.Option(help="'torch DIR': torch CSVs and torchtitan module names")
        ] = None,
        profile: Annotated[list[Path] | None, typer.Option(help=PROFILE_HELP)] = None,
        profiles: Annotated[Path | None, typer.Option(help=PROFILES_HELP)] = None,
        comm_profile: Annotated[Path | None, typer.Option(help=COMM_PROFILE_HELP)] = None,
        max_pp: Annotated[int | None, typer.Option(min=1, help="Most pipeline stages")] = None,
        schedules: Annotated[
            str | None,
            typer.Option(help=f"Families to consider, comma-separated ({', '.join(SEARCHED_FAMILIES)})"),
        ] = None,
        memory_headroom: Annotated[
            float, typer.Option(min=0.0, max=0.95, help="Fraction of each device's memory kept free")
        ] = 0.05,
        exclude_devices: Annotated[str | None, typer.Option(help="Device ids to leave out, e.g. 0,3")] = None,
        micro_batch_sizes: Annotated[
            str | None, typer.Option(help="Micro-batch sizes to consider, e.g. 1,2,4")
        ] = None,
        ablation: Annotated[
            bool,
            typer.Option("--ablation", help="Search again without each freedom: where the gain comes from"),
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON")] = False,
    ) -> None:
        """Search the fastest (or cheapest) plans and rank them by exact simulation."""
        if export is not None and export[0] != "torch":
            raise MedleyInputError(
                f"--export {export[0]}: the only export format is 'torch' (--export torch DIR)"
            )
        if top < 1:
            raise MedleyInputError(f"--top {top}: show at least one plan")
        if out is not None:
            check_output_file(out, flag="--out")
        if export is not None:
            check_output_dir(export[1], flag="--export torch")
        spec = with_comm_profile(parse_cluster_arg(cluster), comm_profile)
        model_spec = get_model(model)
        constraints = _constraints(
            max_pp, schedules, memory_headroom, exclude_devices, micro_batch_sizes, spec
        )
        cost = cost_source(model_spec, spec, profiles=profile or (), profiles_dir=profiles, seq_len=seq_len)
        with PhaseBar(not as_json) as progress:
            result = search(
                spec,
                model_spec,
                global_batch=global_batch,
                seq_len=seq_len,
                cost=cost,
                objective=objective,
                top=top,
                constraints=constraints,
                progress=progress,
            )
        data = result_data(result)
        if ablation:
            data["ablation"] = ablation_data(ablate(result))
        if explain:
            from medley.plan.explain import explain as explain_best

            data["explain"] = explain_best(result).lines()
        if out is not None:
            save_plan(result.best.plan, out)
            data["plan_file"] = str(out)
        if export is not None:
            from medley.plan.export import export_torch

            data["exported"] = [str(p) for p in export_torch(result.best.plan, export[1])]
        if as_json:
            typer.echo(json.dumps(data, indent=2))
            return
        console = make_console()
        print_result(data, console)
        for line in data.get("explain", []):
            console.print(f"· {line}")
        if out is not None:
            console.print(f"best plan written to {out} (`medley show {out}` renders it)")
        if export is not None:
            console.print(f"torch export: {len(data['exported'])} files in {export[1]}")

    @app.command("show")
    def show_cmd(
        plan_file: Annotated[Path, typer.Argument(help="A plan TOML written by `medley plan --out`")],
        gantt: Annotated[Path | None, typer.Option(help="Write a Gantt chart PNG here")] = None,
        trace: Annotated[Path | None, typer.Option(help="Write a Chrome trace (Perfetto) here")] = None,
        profile: Annotated[list[Path] | None, typer.Option(help=PROFILE_HELP)] = None,
        profiles: Annotated[Path | None, typer.Option(help=PROFILES_HELP)] = None,
        comm_profile: Annotated[Path | None, typer.Option(help=COMM_PROFILE_HELP)] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON")] = False,
    ) -> None:
        """Re-simulate a plan file and show its figures per device (and its Gantt chart)."""
        check_pictures(trace=trace, gantt=gantt)
        plan = load_plan(plan_file)
        layout, cluster = plan.layout, with_comm_profile(plan.cluster, comm_profile)
        cost = cost_source(layout.model, cluster, profiles=profile or (), profiles_dir=profiles,
                           seq_len=layout.seq_len)
        prediction, problem, result = predict(layout, cluster, cost=cost)
        write_pictures(result, trace=trace, gantt=gantt)
        data = summary(layout, cluster, problem, result)
        data["cost_source"] = prediction.cost_source
        data["cost_sources"] = layer_sources(layout, cluster, cost)
        if plan.prediction is not None:
            data["saved_step_time_s"] = plan.prediction.step_time_s
            data["saved_cost_source"] = plan.prediction.cost_source
        if as_json:
            typer.echo(json.dumps(data, indent=2))
            return
        console = make_console()
        print_summary(data, console)
        if plan.prediction is not None:
            console.print(
                f"saved prediction: step {plan.prediction.step_time_s:.3f} s from "
                f"{plan.prediction.cost_source}; re-simulated now from {prediction.cost_source}"
            )
        if gantt is not None:
            console.print(f"Gantt chart: {gantt}")
