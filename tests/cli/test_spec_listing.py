"""What the inspection commands list (issue 30's small things): `medley cluster show` gives a
one-device node's ids as one number and a CPU's small TFLOPS figure unrounded; `medley model list`
names every preset."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from medley.cli.main import app
from medley.cli.spec_cmds import tflops_text
from medley.spec.model import PRESETS


def test_small_figures_and_single_ids_read_as_they_are() -> None:
    assert (tflops_text(0.17), tflops_text(7.5), tflops_text(624.0), tflops_text(1234.4)) == \
        ("0.17", "7.5", "624", "1,234")
    result = CliRunner().invoke(app, ["cluster", "show", "1xCPU+2xA100-80GB"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    cpu_row = next(line for line in result.output.splitlines() if "CPU" in line and "node0" in line)
    cells = [cell.strip() for cell in cpu_row.split("│")]
    assert cells[3] == "0" and "0-0" not in result.output  # ids of a one-device node
    assert float(cells[5]) > 0  # the CPU's TFLOPS, not "0"


def test_model_list_names_every_preset_with_its_size() -> None:
    result = CliRunner().invoke(app, ["model", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert list(rows) == list(PRESETS)
    assert 6.5e9 < rows["llama-2-7b"]["params"] < 7e9 and rows["llama-2-70b"]["kv_heads"] == 8
    table = CliRunner().invoke(app, ["model", "list"], env={"COLUMNS": "80"}).output
    assert all(name in table for name in PRESETS) and "6.7 B" in table
    assert "…" not in table and all(len(line) <= 80 for line in table.splitlines()), table


def test_a_model_path_that_is_not_there_is_named_as_a_missing_path() -> None:
    result = CliRunner().invoke(app, ["model", "show", "models/llama-3.2-1b"])
    assert result.exit_code == 2
    assert "model models/llama-3.2-1b: no such file or directory" in result.stderr
    assert "unknown model" not in result.stderr
