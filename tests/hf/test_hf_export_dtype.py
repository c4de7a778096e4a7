"""Exports in bf16 and fp16 (``medley export --dtype``, ``medley train --export-dtype``): the
weights are the checkpoint's cast to that dtype, config.json says it, transformers loads them in
it; a weight beyond fp16's range is refused in one line, and a bad dtype is exit 2 before any
work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import medley.runtime.hf_export as hf_export
from medley.cli.main import app
from medley.errors import MedleyInputError
from medley.hf.read import tensor_files


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name, file in tensor_files(directory).items():
        with safe_open(file, framework="pt") as handle:
            out[name] = handle.get_tensor(name)
    return out


@pytest.mark.timeout(300)
def test_bf16_and_fp16_exports_are_the_weights_cast(hf_models, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    directory = hf_models["llama"]
    ckpt = tmp_path / "ckpt"
    result = CliRunner().invoke(app, [
        "train", "--init-from", str(directory), "--local-ranks", "1", "--micro-batches", "2",
        "--seq-len", "32", "--steps", "1", "--lr", "0", "--checkpoint-dir", str(ckpt),
        "--export-hf", str(tmp_path / "bf16"), "--export-dtype", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    original, step = _tensors(directory), str(ckpt / "step-00000001")
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / dtype
        if dtype != "bf16":
            result = CliRunner().invoke(app, ["export", step, "--hf", str(out), "--dtype", dtype])
            assert result.exit_code == 0, result.output
        exported = _tensors(out)
        assert set(exported) == set(original)
        for name, tensor in original.items():
            assert exported[name].dtype == torch_dtype and torch.equal(exported[name], tensor.to(torch_dtype))
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == str(torch_dtype).removeprefix("torch.")
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        assert next(model.parameters()).dtype == torch_dtype

    line = CliRunner().invoke(app, ["export", step, "--hf", str(tmp_path / "x"), "--dtype", "int8"])
    assert line.exit_code == 2
    assert line.output.strip() == "error: --dtype int8: must be one of fp32, bf16, fp16"
    assert not (tmp_path / "x").exists()

    real = hf_export.read_model_tensors

    def huge(step_dir: Path):  # noqa: ANN202 - what read_model_tensors returns
        spec, params, meta = real(step_dir)
        name = next(iter(params))
        params[name] = params[name].clone().fill_(1e6)
        return spec, params, meta

    monkeypatch.setattr(hf_export, "read_model_tensors", huge)
    with pytest.raises(MedleyInputError, match=r"--dtype fp16: .* beyond fp16's range .*; export bf16"):
        hf_export.export_hf(Path(step), tmp_path / "over", dtype="fp16")
    assert not (tmp_path / "over").exists()
