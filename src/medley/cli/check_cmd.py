"""``medley check PLAN``: a dry run of a plan at its real scale on this one CPU.

Every distinct rank of the plan (or the ranks given) is built alone in torch's fake process group
on the meta device (:mod:`medley.dryrun.ranks`): its process groups, parameter shards and
model-state bytes are shown next to the memory model's prediction, with one micro-batch's
activation bytes traced under fake tensors next to the formulas'. A checkpoint of the plan is then
checked to load under another plan from its DCP metadata alone
(:mod:`medley.dryrun.checkpoint_plan`). A figure more than 2% off its prediction fails the
command with exit status 2 and one line naming the rank and the figure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from medley.cli.console import make_console
from medley.errors import MedleyInputError
from medley.plan.plan import Plan, load_plan

GIB = 2**30
SHOWN_MEMBERS = 8


@dataclass(frozen=True, kw_only=True)
class DryRun:
    """What ``medley check`` found.

    Attributes:
        reports: one per rank built (:class:`medley.dryrun.ranks.RankReport`).
        entries: tensor entries of the checkpoint a save would write; loader: the plan it was
            checked to load under, and the entries that plan needs (None: not checked).
        build_s / checkpoint_s: seconds building and counting the ranks, and checking the checkpoint.
    """

    reports: list[Any]
    entries: int
    loader: str | None
    loaded_entries: int | None
    build_s: float
    checkpoint_s: float


def parse_ranks(text: str | None, world_size: int) -> list[int] | None:
    """``--ranks 0,5,17`` as a list (None: every distinct rank)."""
    if text is None:
        return None
    try:
        ranks = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise MedleyInputError(
            f"--ranks '{text}' must be rank numbers separated by commas, e.g. 0,5,17") from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world_size:
        raise MedleyInputError(
            f"--ranks '{text}': the plan has ranks 0..{world_size - 1}; name ranks among them")
    return ranks


def dry_run(plan: Plan, *, ranks: Sequence[int] | None = None, load_under: Plan | None = None,
            load_under_name: str = "another plan", checkpoint: bool = True) -> DryRun:
    """Build the chosen ranks of ``plan`` (default: each case's :attr:`~medley.dryrun.ranks.
    RankCase.built_ranks`) and check its checkpoint
    loads under ``load_under`` (default: the model on one rank, every tensor whole). The
    checkpoint check needs every case built, so with ``ranks`` it builds the missing ones too."""
    from medley.dryrun.checkpoint_plan import check_loadable, one_rank_plan, save_metadata
    from medley.dryrun.ranks import build_rank, rank_cases
    from medley.plan.world import build_world
    from medley.runtime.setup import check_plan

    check_plan(plan, plan.world_size)
    start = time.perf_counter()
    world = build_world(plan.groups)
    cases = rank_cases(plan, world)
    chosen = [r for c in cases for r in c.built_ranks] if ranks is None else list(ranks)
    case_of = {rank: case for case in cases for rank in case.ranks}
    reports = [build_rank(plan, rank, world=world, case=case_of[rank]) for rank in chosen]
    build_s = time.perf_counter() - start
    if not checkpoint:
        return DryRun(reports=reports, entries=0, loader=None, loaded_entries=None, build_s=build_s,
                      checkpoint_s=0.0)
    start = time.perf_counter()
    built = {report.case.rank: report for report in reports if report.rank == report.case.rank}
    savers = [built.get(c.rank) or build_rank(plan, c.rank, world=world, case=c) for c in cases]
    metadata = save_metadata(savers)
    target = load_under or one_rank_plan(plan)
    if load_under is None:
        load_under_name = "the model on one rank (every tensor whole)"
    check_plan(target, target.world_size)
    target_world = build_world(target.groups)
    loaders = [build_rank(target, c.rank, world=target_world, case=c, measure=False)
               for c in rank_cases(target, target_world)]
    loaded = check_loadable(metadata, loaders, saved_by="this plan", loaded_by=load_under_name)
    return DryRun(reports=reports, entries=len(metadata.state_dict_metadata), loader=load_under_name,
                  loaded_entries=loaded, build_s=build_s, checkpoint_s=time.perf_counter() - start)


def _members(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:SHOWN_MEMBERS]))
    return f"{len(ranks)}: {shown}" + (", ..." if len(ranks) > SHOWN_MEMBERS else "")


def _layers(report: Any) -> str:  # noqa: ANN401 - a RankReport (the runtime is imported lazily)
    return " ".join(f"{first}-{last - 1}" for first, last in report.case.layers)


def _built_cell(built: float, predicted: float) -> str:
    """Built GiB, with how far off the prediction it is when that shows."""
    off = (built - predicted) / predicted * 100 if predicted else (0.0 if not built else float("inf"))
    return f"{built / GIB:.3f}" + ("" if abs(off) < 0.05 else f" ({off:+.1f}%)")


def report_table(result: DryRun) -> Table:
    table = Table(title="GiB per rank built (off the memory model's prediction where it is), one "
                        "micro-batch's activations traced / by the formulas",
                  caption="static: parameters + optimizer state, held all step; gradient: unsharded, after "
                          "a backward; grad shard: after the reduce-scatter; gathered: ZeRO-3's for compute; "
                          "activations traced: what autograd saves on this CPU's kernels (not a GPU's; a "
                          "selective block's kept outputs, held inside checkpoint, are not seen), shown, not "
                          "checked")
    for header in ("rank", "alike", "stages (layers)", "tp", "ZeRO", "dp", "static", "predicted",
                   "parameters", "optimizer", "gradient", "grad shard", "gathered", "activations"):
        table.add_column(header, justify="left" if header.startswith("stages") else "right")
    for r in result.reports:
        case = r.case
        table.add_row(str(r.rank), str(len(case.ranks)), f"{','.join(map(str, case.stages))} ({_layers(r)})",
                      str(case.tp), ",".join(map(str, case.levels)), str(case.zero_dp),
                      _built_cell(r.built.static, r.predicted.static), f"{r.predicted.static / GIB:.3f}",
                      *(_built_cell(getattr(r.built, name), getattr(r.predicted, name))
                        for name in ("parameters", "optimizer", "gradient", "grad_shard", "gathered")),
                      f"{r.activations / GIB:.3f} / {r.predicted_activations / GIB:.3f}")
    return table


def groups_table(result: DryRun) -> Table:
    table = Table(title="Process groups of each rank built (size: members)")
    for header in ("rank", "pipeline (TP groups of its replica)", "tp", "ZeRO groups (per sync segment)"):
        table.add_column(header)
    for r in result.reports:
        pipeline = r.groups["pipeline"]
        flat = [m for ranks in pipeline for m in ranks]
        zero = "; ".join(f"{name.removeprefix('zero ')} {_members(members)}"
                         for name, members in r.groups.items() if name.startswith("zero"))
        table.add_row(str(r.rank), f"{len(pipeline)} x tp: {_members(flat)}", _members(r.groups["tp"]), zero)
    return table


def as_json(result: DryRun, plan_file: Path) -> dict[str, Any]:
    from medley.dryrun.traced_bytes import FIGURES

    def figures(state: Any) -> dict[str, float]:  # noqa: ANN401 - StateFigures
        return {"static": state.static, **{name: getattr(state, name) for name in FIGURES}}

    return {
        "plan": str(plan_file),
        "build_s": result.build_s,
        "checkpoint_s": result.checkpoint_s,
        "ranks": [{"rank": r.rank, "alike_ranks": len(r.case.ranks), "group": r.case.group,
                   "pipeline_rank": r.case.pipeline_rank, "stages": list(r.case.stages),
                   "layers": [list(span) for span in r.case.layers], "tp": r.case.tp,
                   "zero": list(r.case.levels), "zero_dp": r.case.zero_dp, "groups": r.groups,
                   "built": figures(r.built), "predicted": figures(r.predicted),
                   "activations": {"traced": r.activations, "formula": r.predicted_activations},
                   "differences": [{"figure": n, "built": b, "predicted": p} for n, b, p in r.differences()],
                   "shards": [asdict(shard) for shard in r.shards]} for r in result.reports],
        "checkpoint": {"entries": result.entries, "loads_under": result.loader,
                       "entries_needed": result.loaded_entries},
    }


def first_difference(result: DryRun, plan_file: Path) -> str | None:
    """The one line naming the first rank and figure off its prediction, or None."""
    for r in result.reports:
        for name, built, predicted in r.differences():
            off = f"{(built - predicted) / predicted * 100:+.1f}%" if predicted else "predicted none"
            return (f"{plan_file}: rank {r.rank} (stages {','.join(map(str, r.case.stages))}, layers "
                    f"{_layers(r)}, tp {r.case.tp}, ZeRO {','.join(map(str, r.case.levels))}): {name} bytes "
                    f"built {built:,.0f}, predicted {predicted:,.0f} ({off}), more than 2% apart; the "
                    "runtime holds other tensors than medley.cost.zero_memory books for this layout "
                    "(medley check --json lists its shards)")
    return None


def register(app: typer.Typer) -> None:
    @app.command("check")
    def check_cmd(
        plan_file: Annotated[Path, typer.Argument(help="A plan TOML written by `medley plan --out`")],
        ranks: Annotated[str | None, typer.Option(
            help="Ranks to build, e.g. 0,5,17, numbered as medley launch starts them (node by node, each "
                 "node's plan devices in ascending id; default: each set of alike ranks at both ends of its "
                 "ZeRO groups)")] = None,
        load_under: Annotated[Path | None, typer.Option(
            help="Check a checkpoint of the plan loads under this plan (default: the model on one "
                 "rank, every tensor whole)")] = None,
        show_groups: Annotated[bool, typer.Option(
            "--groups", help="Also show each rank's process groups")] = False,
        json_out: Annotated[bool, typer.Option(
            "--json", help="Print every figure, group and shard as JSON")] = False,
    ) -> None:
        """Build a plan's ranks on this CPU (fake process group, meta tensors) and check their memory
        against the plan's prediction and its checkpoint against another plan; exit 2 when a
        figure is more than 2% off."""
        plan = load_plan(plan_file)
        other = load_plan(load_under) if load_under is not None else None
        result = dry_run(plan, ranks=parse_ranks(ranks, plan.world_size), load_under=other,
                         load_under_name=str(load_under))
        if json_out:
            typer.echo(json.dumps(as_json(result, plan_file), indent=1))
        else:
            console = make_console()
            console.print(report_table(result))
            if show_groups:
                console.print(groups_table(result))
            console.print(f"{len(result.reports)} ranks built in {result.build_s:.1f} s (of "
                          f"{plan.world_size:,}; alike: ranks of the same stages, TP degree, ZeRO levels "
                          "and ZeRO group size)")
            console.print(f"checkpoint: {result.entries:,} entries, each tensor's chunks tile it; loads "
                          f"under {result.loader} ({result.loaded_entries:,} entries) "
                          f"[{result.checkpoint_s:.1f} s]")
        problem = first_difference(result, plan_file)
        if problem is not None:
            raise MedleyInputError(problem)
