"""What a refused command looks like (issue 46's tests): exit 2, one line, no traceback."""

from __future__ import annotations

from typer.testing import CliRunner

from medley.cli.main import app

runner = CliRunner()


def one_line_refusal(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]
