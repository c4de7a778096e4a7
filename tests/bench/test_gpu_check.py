"""scripts/gpu-check.sh runs its every step on CPU ranks (``--dry-run``, the tiny model), so the
GPU check's code is not dead where no GPU is lent: catalog match, profile, simulate and train of
every plan (the pp 2 and tp 2 ones with two ranks), the plain FSDP2 loop, JSON and Markdown.
Its figures say nothing about a GPU. About a minute on two cores (seven launches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(400)
def test_the_dry_run_runs_every_step_and_writes_the_report(tmp_path: Path) -> None:
    command = [str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--ranks", "2", "--steps", "2",
               "--out", str(tmp_path)]
    env = {**os.environ, "PYTHON": sys.executable}  # the Python running the tests, wherever its venv is
    done = subprocess.run(command, capture_output=True, text=True, timeout=380, env=env)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads((tmp_path / "gpu-check-dry-run.json").read_text())
    assert report["verdict"] == "every step ran", report["steps"]
    assert report["devices"]["catalog"] == "CPU-8GB"
    assert set(report["profiles"]) == {"bf16", "fp16"} and all(report["profiles"].values())
    names = ["1gpu-bf16", "1gpu-fp16", "pp2-bf16", "pp2-fp16", "tp2-bf16"]
    assert [r["name"] for r in report["runs"]] == names
    for run in report["runs"]:
        world = run["pp"] * run["tp"]
        assert run["predicted"]["step_time_s"] > 0 and run["measured"]["step_time_s"] > 0
        assert len(run["measured"]["peak_memory_bytes"]) == world
        assert set(run["memory_error"]) == set(run["measured"]["peak_memory_bytes"])
        assert all(loss > 0 for loss in run["measured"]["losses"])
    assert report["reference"]["ranks"] == 2 and report["reference"]["mfu"] > 0
    assert report["provenance"]["commit"]
    assert "| pp2-bf16 |" in (tmp_path / "gpu-check-dry-run.md").read_text()
