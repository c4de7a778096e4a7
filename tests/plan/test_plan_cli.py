"""``medley plan`` and ``medley show`` end to end: ranked table, plan file, torch export, explain,
and the messages for bad input (a model that fits nowhere, an infeasible batch, missing prices)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from medley.cli.main import app
from medley.plan.plan import load_plan
from medley.schedule.torch_csv import read_torch_csv
from medley.schedule.validate import validate
from medley.search.rank.baselines import NAMES

CLUSTER = "2xA100-80GB+2xV100-32GB"
PROFILES = str(Path(__file__).parents[1] / "data" / "metis-opt-350")


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_plan_json_out_and_show(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.toml"
    code, out = _run(
        "plan",
        "--cluster",
        CLUSTER,
        "--model",
        "tiny",
        "--global-batch",
        "16",
        "--seq-len",
        "64",
        "--top",
        "3",
        "--out",
        str(plan_file),
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    assert 1 <= len(data["plans"]) <= 3
    best = data["plans"][0]
    assert set(best["versus_baselines"]) == set(NAMES)
    assert 0 < best["aggregate_fraction"] <= 1
    assert set(best["headroom_gb_by_type"]) <= {"A100-80GB", "V100-32GB"}
    for row in data["plans"]:  # tp per pipeline rank; devices counted with their TP groups
        assert len(row["tp"]) == row["pp"] and row["devices_used"] == row["dp"] * sum(row["tp"])
        placed = [d for rank in row["tp_groups"] for group in rank for d in group]  # the device assignment
        assert len(placed) == len(set(placed)) == row["devices_used"]
        sizes = [[len(group) for group in rank] for rank in row["tp_groups"]]
        assert sizes == [[t] * row["dp"] for t in row["tp"]]
    plan = load_plan(plan_file)
    assert data["plans"][0]["tp_groups"] == [[list(plan.layout.group(r, k)) for r in range(plan.layout.dp)]
                                             for k in range(plan.layout.pp)]
    assert plan.prediction is not None
    assert plan.prediction.tokens_per_s == best["tokens_per_s"]
    code, out = _run("show", str(plan_file), "--gantt", str(tmp_path / "g.png"), "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert shown["step_time_s"] == best["step_time_s"]  # re-simulated, same figure
    assert (tmp_path / "g.png").stat().st_size > 0


def test_plan_table_explain_and_torch_export(tmp_path: Path) -> None:
    code, out = _run(
        "plan",
        "--cluster",
        "4xA100-40GB+4xV100-16GB",
        "--model",
        "opt-350m",
        "--global-batch",
        "32",
        "--profiles",
        PROFILES,
        "--explain",
        "--export",
        "torch",
        str(tmp_path / "torch"),
        "--top",
        "2",
    )
    assert code == 0, out
    assert "tokens/s" in out and "vs metis-style" in out and "of bound" in out and "tp per rank" in out
    assert "Bottleneck: device" in out and "Memory: device" in out
    exported = tmp_path / "torch"
    meta = json.loads((exported / "plan.json").read_text())
    parts = json.loads((exported / "module_fqns_per_model_part.json").read_text())
    assert len(parts) == len(meta["stage_layers"])
    flat = [name for part in parts for name in part]
    assert flat[0] == "tok_embeddings" and flat[-2:] == ["norm", "output"]
    assert flat[1:-2] == [f"layers.{i}" for i in range(24)]
    for replica, count in enumerate(meta["micro_batches"]):
        schedule = read_torch_csv(exported / f"replica{replica}.csv", num_micro_batches=count)
        validate(schedule)
        assert schedule.num_stages == len(meta["stage_layers"])


def test_model_that_fits_nowhere_names_the_shortfall_and_the_knobs() -> None:
    code, out = _run(
        "plan", "--cluster", "2xT4-16GB", "--model", "llama-2-70b", "--global-batch", "8", "--seq-len", "4096"
    )
    assert code == 2
    assert "fits nowhere" in out and "GB short on device" in out and "T4-16GB" in out
    assert "Knobs that would close it" in out and "more or larger devices" in out


def test_max_pp_is_named_when_it_is_what_blocks() -> None:
    code, out = _run(
        "plan",
        "--cluster",
        "8xV100-16GB",
        "--model",
        "llama-2-7b",
        "--global-batch",
        "8",
        "--seq-len",
        "2048",
        "--max-pp",
        "1",
    )
    assert code == 2
    assert "raise --max-pp above 1" in out


def test_infeasible_global_batch_says_what_would_work() -> None:
    code, out = _run(
        "plan",
        "--cluster",
        CLUSTER,
        "--model",
        "tiny",
        "--global-batch",
        "100",
        "--seq-len",
        "64",
        "--micro-batch-sizes",
        "8",
    )
    assert code == 2
    assert "--global-batch 100" in out and "96, 104" in out


def test_cost_objective_needs_prices_and_ranks_by_cost(tmp_path: Path) -> None:
    code, out = _run(
        "plan",
        "--cluster",
        CLUSTER,
        "--model",
        "tiny",
        "--global-batch",
        "16",
        "--seq-len",
        "64",
        "--objective",
        "cost",
    )
    assert code == 2 and "price_per_hour" in out
    demo = str(Path(__file__).parents[2] / "examples" / "demo.toml")
    code, out = _run(
        "plan",
        "--cluster",
        demo,
        "--model",
        "tiny",
        "--global-batch",
        "16",
        "--seq-len",
        "64",
        "--objective",
        "cost",
        "--json",
    )
    assert code == 0, out
    costs = [p["cost_per_mtoken_usd"] for p in json.loads(out)["plans"]]
    assert costs == sorted(costs)


def test_bad_flags_name_the_flag() -> None:
    code, out = _run("plan", "--cluster", CLUSTER, "--model", "tiny", "--schedules", "zb-v")
    assert code == 2 and "--schedules" in out
    code, out = _run("plan", "--cluster", CLUSTER, "--model", "tiny", "--exclude-devices", "0,1,2,3")
    assert code == 2 and "--exclude-devices" in out
    code, out = _run("plan", "--cluster", CLUSTER, "--model", "tiny", "--export", "onnx", "x")
    assert code == 2 and "--export onnx" in out


def test_profiles_at_another_sequence_length_are_named() -> None:
    code, out = _run(
        "plan",
        "--cluster",
        "2xA100-40GB+2xV100-16GB",
        "--model",
        "opt-350m",
        "--global-batch",
        "16",
        "--seq-len",
        "1024",
        "--profiles",
        PROFILES,
    )
    assert code == 2 and "--seq-len 2048" in out


def test_explain_names_the_placement_the_written_plan_has(tmp_path: Path) -> None:
    """Issue #11: --explain said bubble-aware while the written plan said placement = "naive"."""
    demo = str(Path(__file__).parents[2] / "examples" / "demo.toml")
    plan_file = tmp_path / "plan.toml"
    code, out = _run("plan", "--cluster", demo, "--model", "llama-2-7b", "--global-batch", "96",
                     "--seq-len", "2048", "--explain", "--out", str(plan_file), "--json")
    assert code == 0, out
    line = next(x for x in json.loads(out)["explain"] if x.startswith("ZeRO placement:"))
    written = load_plan(plan_file).layout.placement.value
    chosen = line.removeprefix("ZeRO placement: ").split(";")[0]
    assert chosen == {"naive": "naive", "bubble": "bubble-aware"}[written], (line, written)


def test_baselines_run_by_default_on_small_clusters_and_on_request() -> None:
    common = ["plan", "--cluster", CLUSTER, "--model", "tiny", "--global-batch", "16", "--seq-len", "64",
              "--top", "1"]
    code, out = _run(*common, "--json")
    assert code == 0 and len(json.loads(out)["baselines"]) == 4
    code, out = _run(*common, "--json", "--no-baselines")
    assert code == 0 and json.loads(out)["baselines"] == {}
    code, out = _run(*common, "--no-baselines")
    assert code == 0 and "--baselines runs them" in out
