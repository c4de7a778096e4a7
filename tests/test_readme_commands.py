"""The README's command list runs as written (issue 30, item 5): every `medley` command of its
"Commands" block that needs neither training nor a GPU runs here, in order, from a directory that
sees the repository's examples/ and tests/ (the paths the README uses), and exits 0. The rest are
named below with the reason they do not run in this test (other tests run each of them)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app

ROOT = Path(__file__).parents[1]
NOT_RUN = {
    "train": "trains for real (tests/runtime/test_train_data_cli.py, test_tp_train.py, ...)",
    "profile": "measures this machine, or needs CUDA (tests/profile/test_measure.py)",
    "fidelity": "trains for real (tests/profile/test_fidelity_quick.py)",
    "export": "needs a checkpoint of a real run (tests/runtime/test_checkpoint_entries.py)",
    "doctor": "checks this node against a GPU plan: exit 2 without the GPUs (tests/cli/test_device_check.py)",
}


def readme_commands() -> list[str]:
    """The lines of the README's first bash block after "## Commands", continuations joined and
    comments dropped."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line.startswith("#") or not line:
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    return commands


def test_the_readme_commands_that_need_no_training_run_as_written(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("examples", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    ran, left = [], []
    for command in readme_commands():
        words = shlex.split(command)
        if words[0] != "medley" or "..." in words:
            left.append(command)  # torchrun lines and "medley plan ... --flag" variants of a full line
            continue
        if words[1] in NOT_RUN:
            left.append(command)
            continue
        result = CliRunner().invoke(app, words[1:], env={"COLUMNS": "120"})
        assert result.exit_code == 0, f"{command}\n{result.output}"
        ran.append(words[1])
    assert {"devices", "cluster", "model", "plan", "show", "check", "simulate", "launch"} <= set(ran)
    assert {shlex.split(c)[1] for c in left if c.startswith("medley") and "..." not in c} <= set(NOT_RUN)
