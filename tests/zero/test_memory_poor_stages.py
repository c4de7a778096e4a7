"""The issue's case: LLaMA-2-13B as 4 stages x 4 replicas on 8x V100-32GB + 8x V100-16GB."""

import json
from pathlib import Path

from typer.testing import CliRunner

from medley.cli.main import app

CLUSTER = Path(__file__).parents[2] / "examples" / "v100-mixed-16.toml"


def _simulate(zero: str) -> dict:
    args = [
        "simulate",
        "--cluster",
        str(CLUSTER),
        "--model",
        "llama-2-13b",
        "--pp",
        "4",
        "--dp",
        "4",
        "--micro-batches",
        "16",
        "--seq-len",
        "2048",
        "--recompute",
        "--zero",
        zero,
        "--gather-windows",
        "0",
        "--buckets",
        "10",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_zero_1_does_not_fit_the_16gb_stages_and_whole_stage_zero_3_does_not_save_them() -> None:
    """ZeRO-1 overflows the V100-16GB stages. ZeRO-3 as medley's runtime runs it gathers a stage's
    every bucket for each compute action (buckets split its collectives, not its compute), so its
    backward holds the whole gathered stage and its whole gradient beside the shards: more than
    ZeRO-1's gathered weights and gradient, not less. (Streaming buckets inside a compute action,
    which would let ZeRO-3 save these stages, needs the runtime to gather per bucket in there.)"""
    everywhere_1 = _simulate("1")
    assert not everywhere_1["fits"]
    by_type = {d["type"]: d for d in everywhere_1["devices"]}
    assert by_type["V100-32GB"]["fits"] and not by_type["V100-16GB"]["fits"]

    mixed = _simulate("1,1,3,3")
    assert not mixed["fits"]
    short = {tuple(d["stages"]): d["headroom_gb"] for d in everywhere_1["devices"]
             if d["type"] == "V100-16GB"}
    for device in mixed["devices"]:
        if device["type"] == "V100-16GB":
            assert set(device["stages"]) <= {2, 3}
            assert device["headroom_gb"] < short[tuple(device["stages"])] < 0
    # Sharding costs communication: ZeRO-3 stages report collective time, the step is longer.
    assert mixed["step_time_s"] >= everywhere_1["step_time_s"]
    assert all(s["zero_comm_s"] > 0 for s in mixed["stages"] if s["level"] == 3)
