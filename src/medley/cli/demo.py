"""``medley demo``: the built-in example, end to end as far as medley goes today.

Shows the demo cluster (4x A100-80GB, 4x V100-32GB, 4x T4-16GB over 25 GbE) and a model's cost
per device type, then simulates one heterogeneous plan with ZeRO placed naively and bubble-aware,
and writes the Chrome trace and Gantt chart of the bubble-aware one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from medley.cli.errors import exit_on_input_error
from medley.cli.simulate_cmd import print_summary, summary, write_pictures
from medley.cli.spec_cmds import print_cluster, print_model_costs
from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.predict import simulate_layout
from medley.spec.cluster import load_cluster
from medley.spec.model import get_model

DEMO_CLUSTER = Path(__file__).resolve().parents[3] / "examples" / "demo.toml"


def run_demo(*, out_dir: Path, model_name: str, console: Console) -> dict:
    cluster = load_cluster(DEMO_CLUSTER)
    model = get_model(model_name)
    print_cluster(cluster, console)
    print_model_costs(model, cluster, micro_batch_size=1, seq_len=2048, console=console)
    cost = CatalogCostSource.for_cluster(model, cluster)
    figures, results = {}, {}
    for placement in ("naive", "bubble"):
        layout = inline_layout(
            cluster=cluster,
            model=model,
            cost=cost,
            pp=3,
            dp=4,
            schedule="1f1b",
            micro_batches="16",
            micro_batch_size=1,
            seq_len=2048,
            zero="3,1,3",
            placement=placement,
        )
        problem, result = simulate_layout(layout, cluster)
        figures[placement] = summary(layout, cluster, problem, result)
        results[placement] = result
    console.rule("One plan: pp=3 (A100 | V100 | T4 stages), dp=4, 1F1B, ZeRO 3,1,3, bubble-aware placement")
    print_summary(figures["bubble"], console)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_pictures(results["bubble"], trace=out_dir / "demo-trace.json", gantt=out_dir / "demo-gantt.png")
    exposed = {p: sum(s["exposed_s"] for s in f["stages"]) for p, f in figures.items()}
    console.print(
        f"ZeRO communication exposed: naive {exposed['naive'] * 1e3:.0f} ms, bubble-aware "
        f"{exposed['bubble'] * 1e3:.0f} ms; step {figures['naive']['step_time_s']:.3f} s -> "
        f"{figures['bubble']['step_time_s']:.3f} s"
    )
    console.print(f"Trace (open in https://ui.perfetto.dev): {out_dir / 'demo-trace.json'}")
    console.print(f"Gantt chart: {out_dir / 'demo-gantt.png'}")
    return figures


def register(app: typer.Typer) -> None:
    @app.command("demo")
    @exit_on_input_error
    def demo(
        out: Annotated[Path, typer.Option(help="Where the pictures go")] = Path("out"),
        model: Annotated[str, typer.Option(help="Model preset to show and simulate")] = "llama-2-7b",
    ) -> None:
        """Show the demo cluster and model costs, simulate one plan and write its pictures."""
        run_demo(out_dir=out, model_name=model, console=Console())
