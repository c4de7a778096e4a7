"""``medley train --checkpoint-dir D`` that resumes says so on the console (issue 46, finding 8):
rank 0 prints one line, ``resumed from step N (checkpoint D/step-0000000N; S sequences seen; the
schedule)``; a fresh run does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

MEDLEY = str(Path(sys.executable).with_name("medley"))
TRAIN = [MEDLEY, "train", "--local-ranks", "1", "--seq-len", "16", "--dtype", "fp32"]


def train(directory: Path, steps: int) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*TRAIN, "--steps", str(steps), "--checkpoint-dir", str(directory), "--json",
                           "--extend-schedule"],
                          capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr
    return done


def resumed_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "resumed from" in line]


@pytest.mark.timeout(240)
def test_a_resume_prints_the_step_and_checkpoint_and_a_fresh_run_does_not(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    fresh = train(directory, 2)
    assert resumed_lines(fresh.stderr) == [], fresh.stderr
    again = train(directory, 4)
    assert resumed_lines(again.stderr) == [
        f"resumed from step 2 (checkpoint {directory / 'step-00000002'}; 16 sequences seen; cosine over 4 "
        "steps, lr 0.003 -> 0.0003, 5 warm-up)"]
