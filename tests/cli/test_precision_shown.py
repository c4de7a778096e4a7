"""The precision a plan trains in, and why, is shown where a user looks (issue 30, item 2): the
plan table and --json, --explain, show and simulate. V100/T4-class parts have no bf16, so any
plan using one trains in fp16 with loss scaling; planned for a model stored in bf16, that is
warned about."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from medley.cli.main import app

runner = CliRunner()
PLAN = ["plan", "--model", "tiny", "--global-batch", "8", "--seq-len", "64", "--top", "1"]
SIMULATE = ["simulate", "--model", "tiny", "--pp", "2", "--seq-len", "64"]


def output(args: list[str]) -> str:
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_a_v100_plan_says_fp16_and_why_everywhere() -> None:
    data = json.loads(output([*PLAN, "--cluster", "2xV100-32GB", "--json"]))
    best = data["plans"][0]
    assert best["precision"] == "fp16 with loss scaling: V100-32GB has no bf16"
    assert best["replica_groups"][0]["dtype"] == "fp16"
    table = output([*PLAN, "--cluster", "2xV100-32GB", "--explain"])
    assert "precision of plan 1: fp16 with loss scaling: V100-32GB has no bf16" in table
    assert "Precision: fp16 with loss scaling: V100-32GB has no bf16." in table
    shown = output([*SIMULATE, "--cluster", "2xV100-32GB"])
    assert "· fp16" in shown and "precision: fp16 with loss scaling: V100-32GB has no bf16" in shown


def test_an_a100_plan_says_bf16_and_fp32_is_as_set() -> None:
    simulate = [*SIMULATE, "--cluster", "2xA100-80GB", "--json"]
    assert json.loads(output(simulate))["precision"] == "bf16: every device of the plan has it"
    assert json.loads(output([*simulate, "--dtype", "fp32"]))["precision"].startswith("fp32: as set")


def test_plan_dtype_sets_every_plans_precision_and_refuses_bf16_where_a_device_lacks_it() -> None:
    for dtype, cluster in (("fp32", "2xA100-80GB"), ("fp16", "2xA100-80GB"), ("fp32", "2xV100-32GB")):
        data = json.loads(output([*PLAN, "--cluster", cluster, "--dtype", dtype, "--json"]))
        assert {group["dtype"] for row in data["plans"] for group in row["replica_groups"]} == {dtype}
        assert data["plans"][0]["precision"] == f"{dtype}: as set (plan --dtype or the plan file)"
    half = json.loads(output([*PLAN, "--cluster", "2xA100-80GB", "--json"]))["plans"][0]["step_time_s"]
    full = json.loads(output([*PLAN, "--cluster", "2xA100-80GB", "--dtype", "fp32", "--json"]))
    assert full["plans"][0]["step_time_s"] > half  # timed at the fp32 peak, not the half one
    result = runner.invoke(app, [*PLAN, "--cluster", "2xA100-80GB+2xV100-32GB", "--dtype", "bf16"])
    assert result.exit_code == 2
    assert "--dtype bf16: V100-32GB has no bf16; give --dtype fp16 or fp32" in result.stderr


def test_fp16_planned_for_a_model_stored_in_bf16_warns(tmp_path) -> None:  # noqa: ANN001 - pytest's Path
    from medley.spec.hf_config import hf_dict_from_spec
    from medley.spec.model_arg import get_model

    config = {**hf_dict_from_spec(get_model("tiny")), "torch_dtype": "bfloat16"}
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["plan", "--model", str(tmp_path), "--global-batch", "8", "--seq-len", "64", "--top", "1"]
    data = json.loads(output([*args, "--cluster", "2xV100-32GB", "--json"]))
    assert data["warnings"] == [
        f"the plan trains in fp16 (a device type it uses has no bf16) but {tmp_path} is stored in bf16 "
        "(config.json): values beyond fp16's range overflow, and the loss scale skips those steps; "
        "--dtype bf16 plans without the devices that lack it (--explain compares the two)"]
    assert "warning: the plan trains in fp16" in output([*args, "--cluster", "2xV100-32GB"])
    assert "warnings" not in json.loads(output([*args, "--cluster", "2xA100-80GB", "--json"]))
    config["torch_dtype"] = "float32"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "warnings" not in json.loads(output([*args, "--cluster", "2xV100-32GB", "--json"]))
