"""scripts/gpu-check.sh runs its every step on CPU ranks (``--dry-run``, the tiny model), so the
GPU check's code is not dead where no GPU is lent: probe, plan, the catalog's and a profile's
prediction, the refusal of a 2-rank GPU plan, the plain PyTorch loop eager and compiled
(``aot_eager``), medley train, the interleaved case against one process, the checks, JSON and
Markdown. Its figures say nothing about a GPU. About 40 s on two cores (eight launches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(300)
def test_the_dry_run_runs_every_step_and_writes_the_report(tmp_path: Path) -> None:
    command = [str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHON": sys.executable}  # the Python running the tests, wherever its venv is
    env.pop("OUT", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads((tmp_path / "gpu-check-dry-run.json").read_text())
    assert report["verdict"] == "every step ran", report["steps"]
    assert report["devices"]["catalog"] == "CPU-8GB"
    case = report["cases"]["tiny"]
    assert (
        case["plan"]["pp"] == 1 and case["plan"]["micro_batch_size"] * case["plan"]["micro_batches"][0] == 8
    )
    for source in ("catalog", "profile"):
        assert case["predicted"][source]["step_time_s"] > 0 and case["predicted"][source]["source"] == source
    eager = case["medley"]["eager"]
    assert eager["timed_steps"] == 2 and eager["step_time_s"] > 0 and eager["tokens_per_s"] > 0
    assert set(eager["peak_memory_bytes"]) == {"0"} and all(loss > 0 for loss in eager["losses"])
    phases = case["plain"]["phases"]
    assert set(phases) == {"eager", "compiled"} and phases["compiled"]["backend"] == "aot_eager"
    assert all(p["step_time_s"] > 0 and len(p["losses"]) == 4 for p in phases.values())
    refusal = report["refusal"]
    assert refusal["refused"] == (refusal["rc"] == 2 and refusal["stderr_lines"] == 1)
    (inter,) = report["interleaved"]
    assert inter["virtual_stages"] == 2 and inter["same_length"] and inter["max_rel_diff"] < 1e-5
    names = {c["check"] for c in report["checks"]}
    assert {
        "tiny eager: medley tokens/s >= plain loop's",
        "tiny: predicted/measured step time (catalog)",
        "tiny: predicted/measured peak memory (profile)",
        "2-rank plan on one GPU: one line, exit 2",
    } <= names
    assert report["provenance"]["commit"] and report["provenance"]["command"]
    assert "| tiny | medley eager |" in (tmp_path / "gpu-check-dry-run.md").read_text()
