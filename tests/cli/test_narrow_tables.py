"""Issue #11: in an 80- or 100-column terminal the ranked-plan table cut the numbers that matter
(`28,6…` tokens/s, `A100…`). Every table the CLI prints keeps every cell whole at any width."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.table import Table
from typer.testing import CliRunner

from medley.cli.console import make_console, print_table
from medley.cli.main import app
from medley.spec.catalog import load_catalog

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "demo.toml")
PLAN = ["plan", "--cluster", DEMO, "--model", "llama-2-7b", "--global-batch", "96", "--seq-len", "2048",
        "--top", "3"]


def run(args: list[str], columns: int) -> str:
    result = CliRunner().invoke(app, args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("columns", [80, 100])
def test_the_ranked_plans_show_every_number_whole(columns: int) -> None:
    data = json.loads(run([*PLAN, "--json"], 200))
    out = run(PLAN, columns)
    assert "…" not in out and "..." not in out
    assert all(len(line) <= columns for line in out.splitlines())
    for row in data["plans"]:
        assert f"{row['tokens_per_s']:,.0f}" in out
        assert f"{row['step_time_s']:.3f} s" in out
        for device_type, gb in row["headroom_gb_by_type"].items():
            assert f"{device_type}:{gb:.1f}" in out


@pytest.mark.parametrize("args", [
    ["devices"],
    ["cluster", "show", DEMO],
    ["model", "show", "llama-2-7b", "--cluster", DEMO],
    ["simulate", "--cluster", DEMO, "--model", "llama-2-7b", "--pp", "3", "--dp", "4",
     "--micro-batches", "16",
     "--zero", "3,1,3"],
])
def test_every_table_fits_80_columns_without_cutting(args: list[str]) -> None:
    out = run(args, 80)
    assert "…" not in out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "A100-80GB" in out


@settings(max_examples=40, deadline=None)
@given(width=st.integers(20, 160), cells=st.lists(st.text("0123456789,.", min_size=1, max_size=14),
                                                 min_size=1, max_size=24))
def test_print_table_never_cuts_a_cell(width: int, cells: list[str]) -> None:
    table = Table(title="t")
    names = [f"column {i}" for i in range(len(cells))]
    for name in names:
        table.add_column(name)
    table.add_row(*cells)
    table.add_row(*reversed(cells))
    console = make_console()
    console.width = width
    with console.capture() as capture:
        print_table(console, table)
    out = capture.get()
    assert "…" not in out
    text = out.replace("\n", "")
    for cell in cells:
        assert cell in text or len(cell) + 2 > width  # a cell wider than the screen folds, never cut


def test_every_help_text_fits_80_columns_without_cutting_an_option() -> None:
    """rich's help panels cut long option names at 80 columns (`--checkpoint-eve…`); the plain
    help wraps the descriptions and keeps every name whole."""
    import typer

    group = typer.main.get_command(app)
    commands = [[name] for name in group.commands]  # type: ignore[attr-defined]
    commands += [[name, sub] for name, cmd in group.commands.items()  # type: ignore[attr-defined]
                 for sub in getattr(cmd, "commands", {})]
    for args in commands:
        out = run([*args, "--help"], 80)
        assert "…" not in out and all(len(line) <= 80 for line in out.splitlines()), (args, out)


def test_the_device_catalog_is_one_line_per_type_in_80_columns(tmp_path: Path) -> None:
    """A new user's `medley devices` at 80 columns was ~185 lines (every type as a block of
    `field value` lines); now one row per type, with --wide for the full headers and bandwidth."""
    names = list(load_catalog())
    out = run(["devices"], 80)
    lines = out.splitlines()
    assert len(lines) <= len(names) + 6, out
    assert "…" not in out and all(len(line) <= 80 for line in lines), out
    rows = [line for line in lines if line.startswith("│ ")]
    assert [row.split("│")[1].strip() for row in rows] == names  # one row per type, in catalog order
    a100 = next(row for row in rows if row.startswith("│ A100-80GB "))
    assert [cell.strip() for cell in a100.split("│")[1:-1]] == [
        "A100-80GB", "80", "312", "19.5", "yes", "nvlink 300", "high"]
    wide = run(["devices", "--wide"], 140)
    assert "mem BW GB/s" in wide and "2039" in wide and all(name in wide for name in names)
    extra = tmp_path / "extra.toml"
    extra.write_text('[devices."A100-80GB"]\nmemory_gb = 81\n')
    out = run(["devices", "--catalog", str(extra)], 80)
    assert len(out.splitlines()) <= len(names) + 6 and "│ A100-80GB       │     81 │" in out
    entries = {e["name"]: e for e in json.loads(run(["devices", "--json", "--catalog", str(extra)], 80))}
    assert list(entries) == names and entries["A100-80GB"]["memory_gb"] == 81
