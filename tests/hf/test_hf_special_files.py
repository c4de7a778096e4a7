"""Issue 26, finding 13: a FIFO as a safetensors shard, its index or config.json (once blocked
forever) is refused at once in one line naming it; each case runs under a timeout."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.errors import MedleyInputError
from medley.runtime.hf_weights import check_hf_weights
from medley.spec.model_arg import get_model

TRAIN = ["--local-ranks", "1", "--pp", "1", "--seq-len", "32", "--steps", "1"]


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def one_line(args: list[str]) -> str:
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def _model_dir(hf_models: dict[str, Path], tmp_path: Path, name: str) -> Path:
    """A copy of the tiny Mistral directory with ``name`` replaced by a FIFO."""
    directory = tmp_path / "model"
    shutil.copytree(hf_models["mistral"], directory)
    fifo(directory / name)
    return directory


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_fifo_in_a_model_directory_is_refused_at_once(hf_models, tmp_path: Path, name: str) -> None:
    directory = _model_dir(hf_models, tmp_path, name)
    if name == "config.json":
        line = one_line(["model", "show", str(directory)])
    else:
        model = str(hf_models["mistral"])
        line = one_line(["train", "--model", model, "--init-from", str(directory), *TRAIN])
    assert f"{directory / name}: is a FIFO (named pipe)" in line, line


@pytest.mark.timeout(60)
def test_a_fifo_shard_or_index_is_refused_at_once(hf_models, tmp_path: Path) -> None:
    """The sharded LLaMA directory: a shard the index names, then the index itself."""
    directory = tmp_path / "llama"
    shutil.copytree(hf_models["llama"], directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = fifo(directory / sorted(set(index["weight_map"].values()))[1])
    spec = get_model(str(directory))
    with pytest.raises(MedleyInputError, match=f"{shard}: is a FIFO"):
        check_hf_weights(spec, directory)
    fifo(directory / "model.safetensors.index.json")
    with pytest.raises(MedleyInputError, match="model.safetensors.index.json: is a FIFO"):
        check_hf_weights(spec, directory)
