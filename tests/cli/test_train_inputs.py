"""``medley train`` answers before it imports torch: a missing input is one line (exit 2), and a
checkpoint directory that already holds the last step says there is nothing to train (exit 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from medley.cli.train_inputs import finished_line
from medley.runtime.checkpoint_layout import checkpoint_path

# Runs medley's CLI in a fresh interpreter and reports whether torch got imported.
PROBE = ("import sys\nfrom medley.cli.main import app\nsys.argv = ['medley', *sys.argv[1:]]\n"
         "try:\n    app()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
         "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)")


def _probe(*args: str, cwd: Path) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)
    return done.stdout.strip().splitlines()[-1], done.stderr


@pytest.mark.parametrize("flag", ["--data", "--val-data", "--tokenizer", "--chat-template", "--init-from",
                                  "--plan"])
def test_a_missing_input_is_one_line_before_torch(tmp_path: Path, flag: str) -> None:
    verdict, err = _probe("train", flag, "missing.jsonl", cwd=tmp_path)
    assert verdict == "NO-TORCH 2"
    assert f"{flag} missing.jsonl: no such file or directory; check the path" in err


def test_a_finished_run_has_nothing_to_do(tmp_path: Path) -> None:
    step = checkpoint_path(tmp_path / "ckpt", 5)
    step.mkdir(parents=True)
    (step / "medley.json").write_text(json.dumps({"next_step": 5}))
    verdict, err = _probe("train", "--checkpoint-dir", "ckpt", "--steps", "5", cwd=tmp_path)
    assert verdict == "NO-TORCH 0"
    assert "step-00000005 already holds step 5 of --steps 5: nothing to train" in err
    assert finished_line(tmp_path / "ckpt", 6) is None  # more steps: the run resumes as usual
    (step / "medley.json").write_text("{not json")
    assert finished_line(tmp_path / "ckpt", 5) is None  # damaged: resume's own checks decide
