"""``medley simulate`` end to end: figures, pictures, two-direction schedules and bad flags."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app

DEMO = str(Path(__file__).parents[2] / "examples" / "demo.toml")


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_json_figures_and_pictures(tmp_path: Path) -> None:
    code, out = _run(
        "--cluster",
        DEMO,
        "--model",
        "llama-2-7b",
        "--pp",
        "3",
        "--dp",
        "4",
        "--micro-batches",
        "8",
        "--zero",
        "3,1,3",
        "--trace",
        str(tmp_path / "t.json"),
        "--gantt",
        str(tmp_path / "g.png"),
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    assert len(data["devices"]) == 12 and data["step_time_s"] > 0 and 0 < data["mfu"] < 1
    assert sum(data["split"]) == 34  # every layer of LLaMA-2-7B (32 blocks + embedding + head), once
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "g.png").stat().st_size > 10_000


def test_no_comm_homogeneous_1f1b_bubble_is_the_closed_form() -> None:
    # Stages 0 and 3 hold only the embedding and the head (microseconds), so the two equal block
    # stages form a 2-stage pipeline: busy = 1 - (p-1)/(m+p-1) = 8/9 with p=2, m=8.
    code, out = _run(
        "--cluster",
        "4xA100-80GB",
        "--model",
        "llama-2-7b",
        "--pp",
        "4",
        "--micro-batches",
        "8",
        "--split",
        "1,16,16,1",
        "--no-comm",
        "--json",
    )
    assert code == 0, out
    data = json.loads(out)
    middle = [d for d in data["devices"] if d["stages"] in ([1], [2])]
    for device in middle:
        assert device["busy"] == pytest.approx(8 / 9, abs=0.01)


def test_bidirectional_holds_the_model_twice() -> None:
    base = [
        "--cluster",
        "4xA100-80GB",
        "--model",
        "llama-2-7b",
        "--pp",
        "4",
        "--micro-batches",
        "8",
        "--json",
    ]
    code, out = _run(*base, "--schedule", "bidirectional")
    assert code == 0, out
    two_way = json.loads(out)
    assert two_way["split"][:4] == two_way["split"][4:]
    one_way = json.loads(_run(*base, "--schedule", "1f1b")[1])
    for a, b in zip(two_way["devices"], one_way["devices"], strict=True):
        assert a["static_memory_gb"] == pytest.approx(2 * b["static_memory_gb"], rel=0.15)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--split", "1,2"], "--split"),
        (["--zero", "4"], "ZeRO levels"),
        (["--pp", "8", "--dp", "4"], "lower --pp or --dp"),
        (["--schedule", "zb-q"], "unknown schedule family"),
        (["--micro-batches", "4,x"], "--micro-batches"),
    ],
)
def test_bad_flags_get_one_clear_message(flags: list[str], message: str) -> None:
    code, out = _run("--cluster", DEMO, "--model", "llama-2-7b", "--pp", "3", *flags)
    assert code == 2
    assert message in out and "Traceback" not in out


@pytest.mark.parametrize(("flag", "value"), [("--buckets", "0"), ("--gather-windows", "-1"), ("--pp", "0"),
                                             ("--seq-len", "0"), ("--micro-batch-size", "-2")])
def test_out_of_range_numbers_are_usage_errors_not_tracebacks(flag: str, value: str) -> None:
    """Issue #11: `simulate --buckets 0` and `--gather-windows -1` ended in a ValueError traceback."""
    result = CliRunner().invoke(app, ["simulate", "--cluster", "2xA100-80GB", "--model", "tiny", flag, value],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Invalid value for '{flag}'" in result.output


def test_opt350_parts_sum_to_the_step_and_the_drain_is_not_zero_time() -> None:
    """A clipped 1F1B plan on the public OPT-350 profiles (A100 + V100): the report's parts sum
    to the step on every device, exposed ZeRO stays within the device's stages' collective time,
    and the last stage's wait for the first (the drain, until the world-wide CLIP) is the clipping
    barrier, not ZeRO time (it used to show as ~300 ms of exposed ZeRO beside a 1 ms collective)."""
    profiles = str(Path(__file__).parents[1] / "data" / "metis-opt-350")
    code, out = _run("--cluster", "8xA100-40GB+8xV100-16GB", "--model", "opt-350m", "--pp", "4", "--dp", "4",
                     "--micro-batches", "16", "--micro-batch-size", "2", "--profiles", profiles, "--json")
    assert code == 0, out
    data = json.loads(out)
    comm = {s["stage"]: s["zero_comm_s"] for s in data["stages"]}
    parts = ("compute_s", "bubble_s", "exposed_transfer_s", "exposed_zero_s", "exposed_clip_s",
             "clip_barrier_s")
    for device in data["devices"]:
        assert sum(device[p] for p in parts) == pytest.approx(data["step_time_s"], abs=1e-9)
        assert device["exposed_zero_s"] <= sum(comm[s] for s in device["stages"]) + 1e-9
    last = [d for d in data["devices"] if d["rank"] == 3]
    assert all(d["clip_barrier_s"] > 0.1 and d["exposed_zero_s"] < 0.01 for d in last)


def test_tp_flag_simulates_groups_and_names_every_device(tmp_path: Path) -> None:
    code, out = _run("--cluster", "8xA100-80GB", "--model", "llama-2-7b", "--pp", "2", "--dp", "2",
                     "--tp", "2,1", "--micro-batches", "4", "--seq-len", "1024", "--zero", "1", "--trace",
                     str(tmp_path / "t.json"), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["tp"] == [2, 1]
    assert data["tp_groups"] == [[[0, 1], [2, 3]], [[4], [5]]]
    rows = {d["device"]: d for d in data["devices"]}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    assert (rows[1]["tp"], rows[1]["tp_rank"], rows[1]["stages"]) == (2, 1, [0])
    assert rows[1]["peak_memory_gb"] == rows[0]["peak_memory_gb"]
    names = [e["args"]["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["name"] == "process_name"]
    assert "device 3 (replica 1, rank 0, tp rank 1 of 2)" in names
    code, out = _run("--cluster", "8xA100-80GB", "--model", "llama-2-7b", "--pp", "2", "--tp", "4",
                     "--micro-batches", "4", "--seq-len", "1024")
    assert code == 0, out
    assert "tp=4,4" in out and "tensor parallel: rank 0 tp 4 on 0-3; rank 1 tp 4 on 4-7" in out


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tp", "3"], "--tp"),
        (["--tp", "2,2,2"], "--tp"),
        (["--tp", "8", "--dp", "2"], "lower --pp, --dp or --tp"),
        (["--tp", "2", "--assignment", "3,0"], "one node of one device type"),
    ],
)
def test_bad_tp_is_a_usage_error_naming_the_flag(flags: list[str], words: str) -> None:
    code, out = _run("--cluster", "4xA100-80GB+4xA100-80GB", "--model", "llama-2-7b", "--pp", "2",
                     "--micro-batches", "4", "--seq-len", "512", *flags)
    assert code == 2, out
    assert words in out and "Traceback" not in out


def test_show_prints_the_tp_of_each_rank_and_its_groups(tmp_path: Path) -> None:
    from medley.cost.estimator import CatalogCostSource
    from medley.plan.inline import inline_layout
    from medley.plan.plan import Plan, save_plan
    from medley.spec.cluster_load import parse_cluster_arg
    from medley.spec.model_arg import get_model

    cluster, model = parse_cluster_arg("8xA100-80GB"), get_model("tiny")
    cost = CatalogCostSource.for_cluster(model, cluster)
    layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=2, dp=2, schedule="1f1b",
                           micro_batches="4", micro_batch_size=1, seq_len=64, tp="2,1")
    save_plan(Plan(layout=layout, cluster=cluster, prediction=None), tmp_path / "p.toml")
    result = CliRunner().invoke(app, ["show", str(tmp_path / "p.toml"), "--gantt", str(tmp_path / "g.png")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "tp=2,1" in result.output
    assert "tensor parallel: rank 0 tp 2 on 0-1, 2-3; rank 1 tp 1" in result.output
    assert "0/0 tp1/2" in result.output and (tmp_path / "g.png").stat().st_size > 0
