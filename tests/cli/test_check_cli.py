"""``medley check PLAN``: the dry run as a command: a table, JSON, and exit 2 naming the rank and
the figure where what is built is more than 2% off what the plan's memory model predicts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typer.testing import CliRunner

from medley.cli.main import app
from medley.plan.plan import Plan, load_plan, save_plan

PLAN = """version = 1

[model]
name = "tiny"

[cluster]
name = "six-a100"
nodes = [{{ name = "node", device = "A100-80GB", count = 6 }}]
tiers = [{{ name = "network", bandwidth_gbps = 12.5, latency_us = 10.0 }}]

[layout]
pp = 2
dp = {dp}
assignment = {assignment}
stage_layers = [3, 3]
schedule = "1f1b"
micro_batches = {micro_batches}
micro_batch_size = 2
seq_len = 16
zero = [{{ level = 1 }}, {{ level = 3, buckets = 2 }}]
dtype = "fp32"
"""


def _plan(directory: Path, dp: int) -> Path:
    path = directory / f"plan-dp{dp}.toml"
    path.write_text(PLAN.format(dp=dp, assignment=[[2 * r, 2 * r + 1] for r in range(dp)],
                                micro_batches=[2] * dp))
    return path


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check", *map(str, args)], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_a_plan_whose_ranks_build_as_predicted_passes(tmp_path: Path) -> None:
    code, out = _run(_plan(tmp_path, 2), "--groups")
    assert code == 0, out
    assert "4 ranks built" in out and "of 4" in out  # both ends of each stage's ZeRO group
    assert "loads under the model on one rank" in out
    assert "Process groups" in out


def test_json_lists_groups_shards_and_both_figures(tmp_path: Path) -> None:
    code, out = _run(_plan(tmp_path, 2), "--json", "--ranks", "1")
    assert code == 0, out
    data = json.loads(out)
    (rank,) = data["ranks"]
    assert rank["rank"] == 1 and rank["stages"] == [1] and rank["zero"] == [3]
    assert rank["groups"]["zero s1"] == [1, 3] and rank["groups"]["tp"] == [1]
    assert rank["built"]["static"] == rank["predicted"]["static"] > 0
    assert rank["built"]["gathered"] > 0  # ZeRO-3 gathered its weights for the micro-batch
    assert {s["name"] for s in rank["shards"]} >= {"head.out.weight", "blocks.3.mlp.up.weight"}
    assert data["checkpoint"]["entries"] == data["checkpoint"]["entries_needed"] > 0


def test_an_edited_plan_whose_prediction_is_off_exits_2_naming_the_rank_and_figure(tmp_path: Path) -> None:
    """The same plan edited to three replicas: FSDP2 cuts the tiny model's 64-row weights 22, 22,
    20 over a ZeRO group of three, and the last replica's ranks hold less optimizer state than the
    memory model's 64/3 rows each books for them."""
    code, out = _run(_plan(tmp_path, 3))
    assert code == 2
    line = out.strip().splitlines()[-1]
    assert line.startswith("error: ") and "plan-dp3.toml: rank 4 (stages 0, layers 0-2" in line
    assert "optimizer bytes built" in line and "more than 2% apart" in line


def test_ranks_out_of_the_plan_are_refused(tmp_path: Path) -> None:
    code, out = _run(_plan(tmp_path, 2), "--ranks", "4")
    assert code == 2 and "--ranks '4': the plan has ranks 0..3" in out


def test_a_checkpoint_is_checked_against_the_plan_given(tmp_path: Path) -> None:
    plan_file = _plan(tmp_path, 2)
    code, out = _run(plan_file, "--ranks", "0", "--load-under", _plan(tmp_path, 3))
    assert code == 0, out  # only the loader's tensors are built for it: its bytes are its own dry run's
    assert "loads under" in out and "plan-dp3.toml" in out
    plan = load_plan(plan_file)
    wider = dataclasses.replace(plan.shared.model, name="tiny-wide", ffn_hidden_size=192)
    other = tmp_path / "wider.toml"
    save_plan(Plan(layout=dataclasses.replace(plan.layout, model=wider), cluster=plan.cluster), other)
    code, out = _run(plan_file, "--load-under", other)
    assert code == 2
    line = out.strip().splitlines()[-1]
    assert "entry 'model.blocks.0.mlp.down.weight'" in line and "in " + str(other) in line
