"""Bad Hugging Face inputs are one line and exit 2, before any rank starts: a missing or mis-shaped
tensor (naming it and its file), an unsupported RoPE type, and bad export arguments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from medley.cli.main import app

TWO_STAGES = ["--local-ranks", "2", "--pp", "2", "--split", "2,3", "--micro-batches", "2", "--seq-len", "32",
              "--steps", "1"]


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def edited_copy(source: Path, target: Path, name: str, tensor: torch.Tensor | None) -> Path:
    """``source`` copied with one tensor of model.safetensors replaced (None: removed)."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_missing_tensor_is_named_with_its_file(hf_models, tmp_path: Path) -> None:
    name = "model.layers.2.mlp.up_proj.weight"
    bad = edited_copy(hf_models["mistral"], tmp_path / "bad", name, None)
    line = one_line_error(["train", "--init-from", str(bad), *TWO_STAGES])
    assert f"{bad / 'model.safetensors'}: tensor '{name}'" in line and "is missing" in line


def test_a_mis_shaped_tensor_is_named_with_its_file(hf_models, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    bad = edited_copy(hf_models["mistral"], tmp_path / "bad", name, torch.zeros(48, 32))
    model = str(hf_models["mistral"])
    line = one_line_error(["train", "--model", model, "--init-from", str(bad), *TWO_STAGES])
    assert f"{bad / 'model.safetensors'}: tensor '{name}' has shape [48, 32] but medley's " in line
    assert "needs [48, 64]" in line


def test_a_directory_of_another_model_is_refused(hf_models) -> None:
    other = str(hf_models["llama31"])
    line = one_line_error(["train", "--model", str(hf_models["llama"]), "--init-from", other])
    assert f"--init-from {hf_models['llama31']}: its config.json has " in line


def test_a_damaged_weights_file_is_one_line(hf_models, tmp_path: Path) -> None:
    shutil.copytree(hf_models["qwen2"], tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not safetensors")
    line = one_line_error(["train", "--init-from", str(tmp_path / "bad"), "--steps", "1"])
    assert f"{tmp_path / 'bad' / 'model.safetensors'}: cannot read it" in line


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_an_unsupported_rope_type_is_named(hf_models, tmp_path: Path, rope_type: str) -> None:
    shutil.copytree(hf_models["llama31"], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    for args in (["model", "show", str(tmp_path / "m")], ["train", "--init-from", str(tmp_path / "m")]):
        line = one_line_error(args)
        assert f"field 'rope_parameters': rope_type '{rope_type}' is not modelled" in line


def test_export_arguments_are_checked(hf_models, tmp_path: Path) -> None:
    line = one_line_error(["export", str(tmp_path / "nowhere"), "--hf", str(tmp_path / "out")])
    assert "not a directory" in line
    line = one_line_error(["export", str(hf_models["llama"]), "--hf", str(tmp_path / "out")])
    assert "no medley.json, so this is not a medley checkpoint step" in line
    line = one_line_error(["export", str(tmp_path), "--hf", str(hf_models["llama"])])
    assert "already exists" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_non_float_tensor_is_refused(hf_models, tmp_path: Path, dtype: torch.dtype) -> None:
    """Issue 26, finding 12: int32 and bool tensors were cast into the float parameters."""
    name = "model.layers.1.mlp.down_proj.weight"
    shape = load_file(hf_models["mistral"] / "model.safetensors")[name].shape
    bad = edited_copy(hf_models["mistral"], tmp_path / "bad", name, torch.ones(shape, dtype=dtype))
    line = one_line_error(["train", "--init-from", str(bad), *TWO_STAGES])
    kind = {torch.int32: "I32", torch.bool: "BOOL"}[dtype]
    assert f"{bad / 'model.safetensors'}: tensor '{name}' holds {kind} values, not floating-point" in line


def test_a_tensor_the_model_lacks_is_refused(hf_models, tmp_path: Path) -> None:
    """Issue 26, finding 12: model.layers.5.* beside a model of fewer blocks was ignored."""
    name = "model.layers.5.mlp.down_proj.weight"
    bad = edited_copy(hf_models["mistral"], tmp_path / "bad", name, torch.zeros(64, 96))
    line = one_line_error(["train", "--init-from", str(bad), *TWO_STAGES])
    assert f"{bad / 'model.safetensors'}: tensor '{name}' is not part of --model" in line
    assert "(3 blocks)" in line


def test_a_nan_weight_names_the_file_and_tensor(hf_models, tmp_path: Path) -> None:
    """Issue 26, finding 15: a NaN weight said "training diverged ... lower --lr"."""
    name = "model.layers.2.self_attn.o_proj.weight"
    weight = load_file(hf_models["mistral"] / "model.safetensors")[name].clone()
    weight[3, 5] = float("nan")
    bad = edited_copy(hf_models["mistral"], tmp_path / "bad", name, weight)
    line = one_line_error(["train", "--init-from", str(bad), *TWO_STAGES])
    assert f"{bad / 'model.safetensors'}: tensor '{name}' holds NaN or infinite values" in line
    assert "diverged" not in line and "--lr" not in line
