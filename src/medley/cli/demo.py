"""``medley demo``: the built-in example, end to end.

1. The demo cluster (4x A100-80GB, 4x V100-32GB, 4x T4-16GB over 25 GbE) and a model's cost per
   device type.
2. The planner's best plans for that model on that cluster, against the baselines, with why the
   best one wins; its Gantt chart and Chrome trace.
3. ZIPPer's point on one hand-made plan: the same ZeRO levels with collectives placed naively and
   in the pipeline bubbles.
4. A real run: a 4-rank emulated mixed cluster on this machine's CPU (two ranks at full speed, two
   stretched 2x, see medley.runtime.emulated_devices), a CPU profile of the tiny model, a plan for it from
   the planner, a few dozen training steps with torch.distributed, and the predicted step time
   next to the measured one.
5. A Hugging Face model made here (tiny LLaMA, BPE tokenizer of the shipped corpus), fine-tuned
   from its weights on the emulated run's plan, exported and loaded back by transformers to
   continue a prompt (:mod:`medley.cli.demo_hf`; transformers is optional).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from medley.cli.console import make_console, print_table
from medley.cli.plan_report import print_result, result_data
from medley.cli.simulate_cmd import write_pictures
from medley.cli.spec_cmds import print_cluster, print_model_costs
from medley.cost.estimator import CatalogCostSource
from medley.fileio import check_output_dir, write_atomically
from medley.lowering.predict import predict, predict_groups
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan, load_plan, save_plan
from medley.search.planner import search
from medley.search.report.explain import explain
from medley.search.space import Constraints
from medley.spec.cluster_load import load_cluster
from medley.spec.model_arg import get_model

DEMO_CLUSTER = Path(__file__).resolve().parents[3] / "examples" / "demo.toml"
EMULATED_SLOWDOWNS = (1.0, 1.0, 2.0, 2.0)
RUN_MODEL, RUN_SEQ_LEN, RUN_MICRO_BATCH, RUN_GLOBAL_BATCH = "tiny", 64, 2, 16


def plan_demo_cluster(*, out_dir: Path, model_name: str, console: Console) -> dict:
    cluster = load_cluster(DEMO_CLUSTER)
    model = get_model(model_name)
    print_cluster(cluster, console)
    print_model_costs(model, cluster, micro_batch_size=1, seq_len=2048, console=console)
    result = search(cluster, model, global_batch=96, seq_len=2048, top=3)
    data = result_data(result)
    print_result(data, console)
    for line in explain(result).lines():
        console.print(f"· {line}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(result.best.plan, out_dir / "demo-plan.toml")
    write_pictures(result.best.result, trace=out_dir / "demo-trace.json", gantt=out_dir / "demo-gantt.png",
                   cluster=cluster)
    console.print(f"Best plan: {out_dir / 'demo-plan.toml'} (`medley show` renders it); "
                  f"Gantt {out_dir / 'demo-gantt.png'}; trace {out_dir / 'demo-trace.json'} "
                  "(open in https://ui.perfetto.dev)")
    return data


def zero_placement_demo(*, model_name: str, console: Console) -> dict[str, float]:
    cluster = load_cluster(DEMO_CLUSTER)
    model = get_model(model_name)
    cost = CatalogCostSource.for_cluster(model, cluster)
    steps = {}
    for placement in ("naive", "bubble"):
        layout = inline_layout(
            cluster=cluster, model=model, cost=cost, pp=3, dp=4, schedule="1f1b", micro_batches="16",
            micro_batch_size=1, seq_len=2048, zero="3,1,3", zero_placement=placement,
        )
        steps[placement] = predict(layout, cluster, cost=cost)[0].step_time_s
    console.rule("ZIPPer: pp=3 (A100 | V100 | T4 stages) x dp=4, 1F1B, ZeRO 3,1,3")
    console.print(f"ZeRO collectives placed naively: step {steps['naive']:.3f} s; in the pipeline "
                  f"bubbles: {steps['bubble']:.3f} s ({steps['naive'] / steps['bubble']:.2f}x)")
    return steps


def emulated_run(*, out_dir: Path, steps: int, console: Console) -> dict:
    """Profile, plan and train on a 4-rank emulated mixed cluster; predicted vs measured."""
    from medley.cost.profile_format import save_profile
    from medley.fidelity.emulate import core_share, emulated_cluster
    from medley.launch.spawn import train_local
    from medley.profile.run import run_profile
    from medley.runtime.train import TrainConfig

    console.rule(f"A real run: {len(EMULATED_SLOWDOWNS)} CPU ranks emulating a mixed cluster "
                 f"(slowdowns {', '.join(f'{f:g}x' for f in EMULATED_SLOWDOWNS)})")
    model = get_model(RUN_MODEL)
    console.print(f"profiling {model.name}'s layers and gloo collectives on this CPU ...")
    profile = run_profile(model, micro_batch_sizes=(RUN_MICRO_BATCH,), seq_lens=(RUN_SEQ_LEN,),
                          comm_ranks=(len(EMULATED_SLOWDOWNS),), runs=5)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_path = out_dir / "demo-profile-cpu.json"
    save_profile(profile, profile_path)
    # Ranks are processes sharing this machine's cores: their compute stretches accordingly.
    emulated = emulated_cluster(profile, model, EMULATED_SLOWDOWNS, directory=out_dir,
                                profile_name=profile_path.name, compute_share=core_share(EMULATED_SLOWDOWNS),
                                name="demo-emulated")
    result = search(emulated.cluster, model, global_batch=RUN_GLOBAL_BATCH, seq_len=RUN_SEQ_LEN,
                    cost=emulated.cost, top=1, baselines=False,
                    constraints=Constraints(micro_batch_sizes=(RUN_MICRO_BATCH,)))
    # The run trains in fp32 with gradient clipping on the CPU: predict exactly that.
    groups = [replace(g, dtype="fp32", clip_grad=True) for g in result.best.plan.groups]
    prediction, _, _ = predict_groups(groups, emulated.cluster, cost=emulated.cost)
    plan = Plan(groups=groups, cluster=emulated.cluster, prediction=prediction)
    save_plan(plan, out_dir / "demo-emulated-plan.toml")
    shapes = " + ".join(
        f"pp={g.pp} x dp={g.dp}, {g.schedule}, split {list(g.stage_layers)}, micro-batches "
        f"{list(g.micro_batches)} x {g.micro_batch_size}, ZeRO {[z.level for z in g.zero]}"
        for g in plan.groups)
    if plan.asymmetric:
        shapes = f"{len(plan.groups)} replica groups of their own shape: {shapes}"
    console.print(f"planned: {shapes} ({out_dir / 'demo-emulated-plan.toml'})")
    records = train_local(plan, TrainConfig.of(steps=steps, emulate=True, data=None, warmup_steps=3))
    timed = [r.step_time_s for r in records[5:]] or [r.step_time_s for r in records]
    measured = {"fastest": min(timed), "median": statistics.median(timed)}
    table = Table(title=f"{model.name}, {steps} steps, {plan.tokens_per_step} tokens per step")
    for column in ("", "step time", "error vs predicted"):
        table.add_column(column, justify="right")
    table.add_row("predicted (simulator, CPU profile)", f"{prediction.step_time_s * 1e3:.1f} ms", "")
    for name, value in measured.items():
        error = (prediction.step_time_s - value) / value
        table.add_row(f"measured, {name} step", f"{value * 1e3:.1f} ms", f"{error:+.1%}")
    print_table(console, table)
    console.print(f"loss {records[0].loss:.3f} -> {records[-1].loss:.3f} over {steps} steps "
                  "(byte-level text of the shipped corpus); the machine is shared, so single steps "
                  "vary (bench/results/fidelity.md has the full fidelity study)")
    return {"predicted_s": prediction.step_time_s, **{f"{k}_s": v for k, v in measured.items()},
            "loss_first": records[0].loss, "loss_last": records[-1].loss}


PARTS = {"plan": "planning", "zero_placement": "ZIPPer", "run": "real run", "hf": "Hugging Face"}


def run_demo(*, out_dir: Path, model_name: str, console: Console, train_steps: int = 30,
             hf_steps: int = 0) -> dict:
    """The demo's parts and their figures; ``hf_steps`` > 0 adds the Hugging Face part, which
    trains on the emulated run's plan (so it needs ``train_steps`` > 0)."""
    seconds: dict[str, float] = {}
    figures: dict = {"seconds": seconds}

    def part(name: str, run: Callable[[], object]) -> None:
        start = time.perf_counter()
        figures[name] = run()
        seconds[name] = round(time.perf_counter() - start, 1)

    part("plan", lambda: plan_demo_cluster(out_dir=out_dir, model_name=model_name, console=console))
    part("zero_placement", lambda: zero_placement_demo(model_name=model_name, console=console))
    if train_steps > 0:
        part("run", lambda: emulated_run(out_dir=out_dir, steps=train_steps, console=console))
    if train_steps <= 0 < hf_steps:
        console.print("the Hugging Face part trains on the emulated run's plan: skipped with --train-steps 0")
    elif hf_steps > 0:
        from medley.cli.demo_hf import hf_finetune

        plan = load_plan(out_dir / "demo-emulated-plan.toml")
        part("hf", lambda: hf_finetune(out_dir=out_dir, plan=plan, steps=hf_steps, emulate=True,
                                       console=console))
    write_atomically(out_dir / "demo-times.json", json.dumps(seconds, indent=1) + "\n")
    console.print("took " + ", ".join(f"{PARTS[name]} {s:.1f} s" for name, s in seconds.items())
                  + f" ({out_dir / 'demo-times.json'})")
    return figures


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Annotated[Path, typer.Option(help="Where the plans, profile and pictures go")] = Path("out"),
        model: Annotated[str, typer.Option(help="Model preset to plan for the demo cluster")] = "llama-2-7b",
        train_steps: Annotated[
            int, typer.Option(help="Steps of the emulated 4-rank run (0 skips it)")
        ] = 30,
        hf_steps: Annotated[
            int, typer.Option(help="Fine-tuning steps of the Hugging Face part on the emulated run's plan "
                              "(0 skips it; it needs the emulated run)")
        ] = 20,
    ) -> None:
        """Plan for the demo cluster, show ZIPPer's placement, train a tiny model on 4 emulated ranks,
        then fine-tune, export and generate from a tiny Hugging Face model."""
        check_output_dir(out, flag="--out")
        run_demo(out_dir=out, model_name=model, console=make_console(), train_steps=train_steps,
                 hf_steps=hf_steps)
