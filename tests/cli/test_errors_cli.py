"""Issue #11, the CLI's side: every exit path is one line and an exit status (2 bad input, 130 Ctrl-C,
1 internal, a traceback only with --debug), user text is printed literally, output paths are
checked before any work, and --help lists the commands in the order of use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli import spec_cmds
from medley.cli.main import ORDER, app
from medley.errors import DEBUG_ENV, MedleyInputError

MEDLEY = str(Path(sys.executable).with_name("medley"))
runner = CliRunner()
SIMULATE = ("simulate", "--cluster", "2xA100-80GB", "--model", "tiny", "--pp", "2", "--seq-len", "64")
PLAN = ("plan", "--cluster", "2xA100-80GB", "--model", "tiny", "--global-batch", "16", "--seq-len", "64")


def one_line_error(args: list[str], *, code: int = 2) -> str:
    """Run ``args``; assert the exit code and exactly one ``error:`` line on stderr, no traceback."""
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("path", ["a[/]b", "x/[red]y.toml", "[bold]c[/bold].toml"])
def test_user_text_in_errors_is_printed_literally(path: str) -> None:
    """`a[/]b` used to turn the real error into a MarkupError traceback; `[red]` vanished."""
    assert path in one_line_error(["cluster", "show", path])


def test_builtin_hints_keep_their_brackets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = tmp_path / "two-nodes.toml"
    cluster.write_text('name = "c"\n[[nodes]]\nname = "a"\ndevice = "A100-80GB"\ncount = 1\n'
                       '[[nodes]]\nname = "b"\ndevice = "T4-16GB"\ncount = 1\n')
    assert "add [[tiers]] with name" in one_line_error(["cluster", "show", str(cluster)])
    hint = 'plan.toml: [model] needs a name; add it, or a table [devices."A100-80GB"] to the catalog'

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise MedleyInputError(hint)

    monkeypatch.setattr(spec_cmds, "load_catalog", refuse)
    assert one_line_error(["devices"]) == f"error: {hint}"


@pytest.fixture()
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR").mkdir()
    assert runner.invoke(app, [*PLAN, "--out", "plan.toml", "--json"]).exit_code == 0
    return tmp_path


@pytest.mark.parametrize(("args", "expected"), [
    ([*PLAN, "--out", "DIR"], "--out DIR: is a directory"),
    ([*PLAN, "--export", "torch", "FILE"], "--export torch FILE: is a file, not a directory"),
    ([*PLAN, "--out", "FILE/x.toml"], "--out FILE/x.toml:"),
    ([*SIMULATE, "--trace", "DIR"], "--trace DIR: is a directory"),
    ([*SIMULATE, "--gantt", "FILE/x.png"], "--gantt FILE/x.png:"),
    ([*SIMULATE, "--gantt", "DIR"], "--gantt DIR: is a directory"),
    ([*SIMULATE, "--gantt", "chart"], "--gantt chart: give a file name ending in .png"),
    (["show", "plan.toml", "--trace", "DIR"], "--trace DIR: is a directory"),
    (["show", "plan.toml", "--gantt", "FILE/x.png"], "--gantt FILE/x.png:"),
    (["profile", "--model", "tiny", "--out", "DIR"], "--out DIR: is a directory"),
    (["fidelity", "--quick", "--out", "FILE"], "--out FILE: is a file, not a directory"),
    (["demo", "--out", "FILE"], "--out FILE: is a file, not a directory"),
])
def test_output_paths_are_checked_before_any_work(paths: Path, args: list[str], expected: str) -> None:
    before = sorted(p.name for p in paths.rglob("*"))
    start = time.monotonic()
    assert expected in one_line_error(args)
    assert time.monotonic() - start < 5  # refused before searching, profiling or training
    assert sorted(p.name for p in paths.rglob("*")) == before  # nothing written (no DIR.png)


def test_an_unwritable_output_location_is_named(paths: Path) -> None:
    if os.geteuid() == 0:  # root passes every mode bit (CI here runs as root); /proc refuses it
        target = Path("/proc/1/t.json")
    else:
        locked = paths / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "t.json"
    assert "permission denied" in one_line_error([*SIMULATE, "--trace", str(target)])


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(spec_cmds, "print_devices", broken)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    line = one_line_error(["devices"], code=1)
    assert line == "error: RuntimeError: boom; second line; rerun with --debug for the traceback"
    result = runner.invoke(app, ["--debug", "devices"])
    assert isinstance(result.exception, RuntimeError) and os.environ[DEBUG_ENV] == "1"
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert isinstance(runner.invoke(app, ["devices"]).exception, RuntimeError)
    monkeypatch.delenv(DEBUG_ENV)


def test_the_console_script_never_prints_a_traceback_by_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    out = subprocess.run([MEDLEY, *SIMULATE, "--gantt", str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0


@pytest.mark.timeout(120)
def test_ctrl_c_exits_130_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    proc = subprocess.Popen([MEDLEY, "profile", "--model", "tiny", "--comm-ranks", "0", "--runs", "50",
                             "--out", str(tmp_path / "p.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the first progress line: the command is running
    assert first.startswith("[1/3]"), first  # layers, optimizer, the runtime's overhead
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "error: interrupted (Ctrl-C)"


def test_help_says_what_medley_does_and_lists_commands_in_order_of_use() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "medley plans, simulates and runs hybrid-parallel" in result.output
    assert "--debug" in result.output
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].splitlines()
              if line.startswith("  ") and not line.startswith("   ") and line.split()[0] in ORDER]
    assert listed == list(ORDER)


@pytest.mark.parametrize(("args", "expected"), [
    (["simulate", "--model", "tiny", "--buckets", "0"], "medley simulate: Invalid value for '--buckets'"),
    (["simulate", "--bogus", "1"], "medley simulate: No such option: --bogus"),
    (["--bogus"], "medley: No such option: --bogus"),
    (["plan", "--global-batch", "x"], "medley plan: Invalid value for '--global-batch'"),
])
def test_usage_errors_are_one_line(args: list[str], expected: str) -> None:
    result = runner.invoke(app, args, env={"COLUMNS": "80"}, prog_name="medley")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "--help" in lines[0], result.stderr


def test_a_bare_medley_still_shows_the_help() -> None:
    result = runner.invoke(app, [], prog_name="medley")
    shown = result.stdout + result.stderr
    assert "Usage: medley" in shown and "error:" not in shown


def test_a_one_rank_plan_needs_one_rank_in_the_singular() -> None:
    line = one_line_error(["train", "--steps", "1", "--model", "tiny", "--seq-len", "16"])
    assert "the plan needs pp 1 x dp 1 = 1 rank: launch with torchrun --nproc-per-node 1" in line
