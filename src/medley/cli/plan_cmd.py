"""``medley plan``: search the best plans for a model on a cluster; ``medley show``: render a plan file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from medley.cli.console import make_console
from medley.cli.error_exit import MedleyInputError
from medley.cli.options import adapter_options
from medley.cli.plan_report import BASELINE_DEVICES, ablation_data, print_result, result_data
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
from medley.lowering.predict import layer_sources, predict_groups
from medley.plan.inline import parse_int_list
from medley.plan.plan import load_plan, save_plan
from medley.plan.world import build_world, device_roles
from medley.search.planner import search
from medley.search.report.ablation import ablate
from medley.search.space import SEARCHED_FAMILIES, Constraints
from medley.spec.adapter import lora_of
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model, trained_dtype


def _constraints(
    max_pp, schedules, memory_headroom, exclude_devices, micro_batch_sizes, cluster, asymmetric=True,
    dtype=None, adapter=None,
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
        asymmetric=asymmetric,
        dtype=dtype,
        adapter=adapter,
    )


def register(app: typer.Typer) -> None:
    @app.command("plan")
    @adapter_options()
    def plan_cmd(
        cluster: Annotated[
            str, typer.Option(help="Cluster TOML file, or a short form like 8xA100-40GB+8xV100-16GB")
        ],
        model: Annotated[str, typer.Option(help="Preset, Hugging Face config.json or model directory")],
        global_batch: Annotated[int, typer.Option(min=1, help="Sequences per optimizer step")] = 512,
        seq_len: Annotated[int | None, typer.Option(
            min=1, help="Tokens per sequence (default: 2048, or the model's longest if shorter)")] = None,
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
        baselines: Annotated[
            bool | None,
            typer.Option("--baselines/--no-baselines",
                         help=f"Also run the baselines (default: on up to {BASELINE_DEVICES} devices)"),
        ] = None,
        asymmetric: Annotated[
            bool,
            typer.Option("--asymmetric/--no-asymmetric",
                         help="Also plan replica groups of their own shape (a pipeline per device type)"),
        ] = True,
        dtype: Annotated[str | None, typer.Option(
            help="bf16, fp16 or fp32 for every plan (default: bf16 where every device has it, "
                 "else fp16)")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON")] = False,
        *,
        adapter_flags: dict,  # --lora-rank, ... (adapter_options)
    ) -> None:
        """Search the fastest (or cheapest) plans and rank them by exact simulation; with
        --lora-rank, plans that train LoRA adapters on a frozen base."""
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
        seq_len = model_spec.default_seq_len() if seq_len is None else seq_len
        adapter = lora_of(rank=adapter_flags["lora_rank"], alpha=adapter_flags["lora_alpha"],
                          dropout=adapter_flags["lora_dropout"], targets=adapter_flags["lora_targets"],
                          model=model_spec)
        constraints = _constraints(
            max_pp, schedules, memory_headroom, exclude_devices, micro_batch_sizes, spec, asymmetric, dtype,
            adapter,
        )
        cost = cost_source(model_spec, spec, profiles=profile or (), profiles_dir=profiles, seq_len=seq_len,
                           dtype=dtype)
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
                baselines=spec.num_devices <= BASELINE_DEVICES if baselines is None else baselines,
            )
        data = result_data(result)
        if dtype is None and result.best.plan.shared.dtype == "fp16" and trained_dtype(model) == "bf16":
            data["warnings"] = [
                f"the plan trains in fp16 (a device type it uses has no bf16) but {model} is stored in bf16 "
                "(config.json): values beyond fp16's range overflow, and the loss scale skips those steps; "
                "--dtype bf16 plans without the devices that lack it (--explain compares the two)"]
        if ablation:
            data["ablation"] = ablation_data(ablate(result))
        if explain:
            from medley.search.report.explain import explain as explain_best

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
        for line in data.get("warnings", []):
            console.print(f"warning: {line}")
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
        baselines: Annotated[
            bool | None,
            typer.Option("--baselines/--no-baselines",
                         help=f"Also run the baselines (default: on up to {BASELINE_DEVICES} devices)"),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON")] = False,
    ) -> None:
        """Re-simulate a plan file and show its figures per device (and its Gantt chart)."""
        check_pictures(trace=trace, gantt=gantt)
        plan = load_plan(plan_file)
        layout, cluster = plan.shared, with_comm_profile(plan.cluster, comm_profile)
        cost = cost_source(layout.model, cluster, profiles=profile or (), profiles_dir=profiles,
                           seq_len=layout.seq_len)
        prediction, problem, result = predict_groups(plan.groups, cluster, cost=cost)
        write_pictures(result, trace=trace, gantt=gantt, roles=device_roles(build_world(plan.groups)),
                       cluster=cluster)
        data = summary(plan.groups, cluster, problem, result)
        data["cost_source"] = prediction.cost_source
        data["cost_sources"] = layer_sources(plan.groups, cluster, cost)
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
