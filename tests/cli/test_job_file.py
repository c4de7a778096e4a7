"""``medley train --config job.toml``: every flag of medley train has exactly one section; the
shipped example trains as it is and a flag on the command line wins over it; relative paths are
the job file's; bad files are one line naming the file and key (exit 2); medley launch checks the
file and hands every node its absolute path; docs/job-file.md lists the keys as generated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from medley.cli.job_file import SECTIONS, reference
from medley.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _train_command():
    return get_command(app).get_command(None, "train")


def test_every_train_flag_has_one_section() -> None:
    names = [p.name for p in _train_command().params if p.name != "job"]
    placed = [name for section in SECTIONS.values() for name in section]
    assert sorted(placed) == sorted(names)


def test_the_docs_list_the_generated_keys() -> None:
    text = (ROOT / "docs" / "job-file.md").read_text()
    generated = text.split("<!-- generated: medley.cli.job_file.reference -->\n")[1].split("<!-- end")[0]
    assert generated == reference(_train_command())


@pytest.mark.timeout(300)
def test_the_example_trains_and_flags_win(tmp_path: Path) -> None:
    examples = tmp_path / "examples"
    examples.mkdir()
    shutil.copy(ROOT / "examples" / "job.toml", examples / "job.toml")
    result = runner.invoke(app, ["train", "--config", str(examples / "job.toml"), "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["records"]
    assert [r["step"] for r in records] == [0, 1]  # --steps 2 won over steps = 20
    # checkpoint_dir and log_jsonl are relative to the job file's directory, not the working one.
    assert (tmp_path / "out" / "job-ckpt" / "step-00000002").is_dir()
    assert len((tmp_path / "out" / "job-log.jsonl").read_text().splitlines()) >= 2


@pytest.mark.parametrize(("body", "message"), [
    ("[optimizer]\nlrr = 1\n", r"job\.toml: \[optimizer\] lrr: not a setting of \[optimizer\]; \[optimizer\] "
                               "takes steps, epochs, optimizer, lr"),
    ("[optimizer]\ndata = 'x.jsonl'\n", r"\[optimizer\] data: not a setting of \[optimizer\]; it belongs in "
                                        r"\[data\]"),
    ("[optim]\nlr = 1\n", r"unknown section \[optim\]; the sections are \[plan\], \[adapter\], \[model\]"),
    ("[optimizer]\nsteps = 0\n", r"\[optimizer\] steps = 0: Invalid value for '--steps'"),
    ("[optimizer]\nlr = 'fast'\n", r'\[optimizer\] lr = "fast": not a number; write lr = 0.003'),
    ("[optimizer\n", "not TOML"),
    ("optimizer = 3\n", "'optimizer' must be a \\[optimizer\\] table"),
])
def test_a_bad_job_file_is_one_line(tmp_path: Path, body: str, message: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(body)
    result = runner.invoke(app, ["train", "--config", str(job)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    import re
    assert re.search(message, lines[0]), lines[0]


def test_launch_checks_the_job_file_and_passes_its_absolute_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan.toml"
    made = runner.invoke(app, ["plan", "--cluster", "2xA100-80GB", "--model", "tiny", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    (tmp_path / "job.toml").write_text("[optimizer]\nsteps = 5\n")
    result = runner.invoke(app, ["launch", "plan.toml", "--rdzv-endpoint", "h:1", "--dry-run", "--json", "--",
                                 "--config", "job.toml"])
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)["nodes"][0]["command"]
    assert f"--config {tmp_path / 'job.toml'}" in command and f"--plan {plan}" in command
    (tmp_path / "job.toml").write_text("[optimizer]\nsteps = 0\n")
    bad = runner.invoke(app, ["launch", "plan.toml", "--rdzv-endpoint", "h:1", "--dry-run", "--",
                              "--config", "job.toml"])
    assert bad.exit_code == 2 and "steps = 0" in bad.output
