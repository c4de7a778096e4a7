import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_devices_table_and_json():
    result = run("devices")
    assert result.exit_code == 0 and "A100-80GB" in result.output and "T4-16GB" in result.output
    entries = json.loads(run("devices", "--json").output)
    assert len(entries) >= 18 and {"name", "peak_tflops_half", "supports_bf16"} <= set(entries[0])


@pytest.mark.parametrize("name", ["demo", "cloud-a100-v100", "large-1024"])
def test_cluster_show_examples(name: str):
    result = run("cluster", "show", str(EXAMPLES / f"{name}.toml"))
    assert result.exit_code == 0, result.output
    data = json.loads(run("cluster", "show", str(EXAMPLES / f"{name}.toml"), "--json").output)
    assert data["num_devices"] == {"demo": 12, "cloud-a100-v100": 16, "large-1024": 1024}[name]
    assert data["total_tflops_half"] > 0 and data["tiers"]


def test_cluster_show_short_form():
    data = json.loads(run("cluster", "show", "4xA100-80GB+4xT4", "--json").output)
    assert data["devices_by_type"] == {"A100-80GB": 4, "T4-16GB": 4}


def test_model_show_table_and_json():
    result = run("model", "show", "llama-2-7b", "--cluster", str(EXAMPLES / "demo.toml"), "--seq-len", "1024")
    assert result.exit_code == 0, result.output
    assert "6.74 B params" in result.output and "V100-32GB" in result.output
    data = json.loads(run("model", "show", "tiny", "--micro-batch-size", "4", "--json").output)
    assert data["micro_batch_size"] == 4 and data["seq_len"] == 128
    block = next(row for row in data["layers"] if row["kind"] == "block")
    assert block["count"] == 4 and set(block["seconds"]) == {"A100-80GB", "V100-32GB", "T4-16GB"}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return str(path)


TWO = '[[nodes]]\nname="n"\ndevice="T4"\ncount=1\n[[nodes]]\nname="m"\ndevice="T4"\ncount=1\n'
BAD = {
    "unknown device type": ('[[nodes]]\nname="n"\ndevice="V100-23GB"\ncount=4\n', "Did you mean: V100-32GB"),
    "zero count": ('[[nodes]]\nname="n"\ndevice="T4"\ncount=0\n', "nodes[0].count"),
    "negative size": ('[[nodes]]\nname="n"\ndevice="T4"\ncount=2\nmemory_gb=-1\n', "nodes[0].memory_gb"),
    "duplicate node names": (
        TWO.replace('"m"', '"n"') + '[[tiers]]\nname="e"\nbandwidth_gbps=1\n',
        "duplicate",
    ),
    "tier with missing group": (
        TWO + '[[tiers]]\nname="e"\nbandwidth_gbps=1\ngroups={g=["n","ghost"]}\n',
        "ghost",
    ),
    "malformed toml": ("[[nodes]\nname=", "malformed TOML"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cluster_files_exit_nonzero_with_one_clear_message(tmp_path: Path, case: str):
    text, expected = BAD[case]
    path = write(tmp_path, text)
    result = run("cluster", "show", path)
    assert result.exit_code == 2
    flat = "".join(result.output.split())  # rich wraps long messages
    assert "".join(expected.split()) in flat and path in flat
    assert "field" in flat or case == "malformed toml"
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_bad_model_arguments_exit_nonzero(tmp_path: Path):
    for args in (
        ["model", "show", "llama-9"],
        ["model", "show", "tiny", "--micro-batch-size", "0"],
        ["model", "show", "tiny", "--cluster", "3xNOPE"],
        ["devices", "--catalog", str(tmp_path / "x")],
    ):
        result = run(*args)
        assert result.exit_code == 2, args
        assert "Traceback" not in result.output
        assert "error:" in result.output or "Invalid value for '--micro-batch-size'" in result.output


def test_model_show_reads_a_hugging_face_config(tmp_path: Path):
    cfg = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "_name_or_path": "my-llama",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    data = json.loads(run("model", "show", str(path), "--seq-len", "512", "--json").output)
    assert data["model"]["name"] == "my-llama" and abs(data["total_params"] - 8.03e9) / 8.03e9 < 0.01
