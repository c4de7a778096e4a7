"""Issue 26, finding 13: a FIFO (or a device, or a directory) where a user file belongs is refused
at once in one line naming it. A FIFO as a cluster TOML once blocked forever (so did a safetensors
shard or config.json: tests/hf/test_hf_special_files.py; data files:
tests/runtime/test_token_cache.py); each case runs under a timeout, so a regression fails
instead of hanging."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app

ROOT = Path(__file__).parents[2]
SIMULATE = ["simulate", "--cluster", "2xCPU-8GB", "--model", "tiny", "--pp", "2", "--split", "2,2",
            "--seq-len", "64", "--micro-batches", "2", "--dtype", "fp32"]


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def one_line(args: list[str]) -> str:
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def _args(case: str, tmp_path: Path) -> tuple[list[str], Path]:
    """The command reading a FIFO for ``case``, and the FIFO."""
    if case == "cluster":
        pipe = fifo(tmp_path / "c.toml")
        return ["cluster", "show", str(pipe)], pipe
    if case == "plan":
        pipe = fifo(tmp_path / "plan.toml")
        return ["show", str(pipe)], pipe
    if case == "catalog":
        text = (ROOT / "examples" / "demo.toml").read_text()
        (tmp_path / "c.toml").write_text('catalog = "devices.toml"\n' + text)
        return ["cluster", "show", str(tmp_path / "c.toml")], fifo(tmp_path / "devices.toml")
    if case == "profile":
        pipe = fifo(tmp_path / "p.json")
        return [*SIMULATE, "--profile", str(pipe)], pipe
    if case == "comm-profile":
        pipe = fifo(tmp_path / "comm.json")
        return [*SIMULATE, "--comm-profile", str(pipe)], pipe
    shutil.copytree(ROOT / "tests" / "data" / "metis-opt-350", tmp_path / "metis")
    pipe = fifo(tmp_path / "metis" / "A100-40" / "mbs2_tmp1.json")
    return ["plan", "--cluster", "8xA100-40GB", "--model", "opt-350m", "--profiles", str(tmp_path / "metis"),
            "--seq-len", "2048", "--global-batch", "64"], pipe


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["cluster", "plan", "catalog", "profile", "comm-profile", "metis"])
def test_a_fifo_for_a_spec_or_profile_file_is_refused_at_once(tmp_path: Path, case: str) -> None:
    args, pipe = _args(case, tmp_path)
    line = one_line(args)
    assert f"{pipe}: is a FIFO (named pipe), not a regular file" in line, line


def test_a_directory_or_device_where_a_file_belongs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.toml").mkdir()
    line = one_line(["cluster", "show", str(tmp_path / "c.toml")])
    assert "c.toml: is a directory, not a regular file" in line
    assert "/dev/zero: is a character device" in one_line(["show", "/dev/zero"])
