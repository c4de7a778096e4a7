"""`medley cluster show`: a one-device node's ids are one number, and a small TFLOPS figure (a
CPU's) is not rounded to 0 (issue 30's list of small things)."""

from __future__ import annotations

from typer.testing import CliRunner

from medley.cli.main import app
from medley.cli.spec_cmds import tflops_text


def test_small_figures_and_single_ids_read_as_they_are() -> None:
    assert (tflops_text(0.17), tflops_text(7.5), tflops_text(624.0), tflops_text(1234.4)) == \
        ("0.17", "7.5", "624", "1,234")
    result = CliRunner().invoke(app, ["cluster", "show", "1xCPU+2xA100-80GB"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    cpu_row = next(line for line in result.output.splitlines() if "CPU" in line and "node0" in line)
    cells = [cell.strip() for cell in cpu_row.split("│")]
    assert cells[3] == "0" and "0-0" not in result.output  # ids of a one-device node
    assert float(cells[5]) > 0  # the CPU's TFLOPS, not "0"
