"""The fidelity harness end to end on two plans: profile, simulate, train for real, report.

Timing targets live in bench/fidelity.py; here the loop must run and produce every figure, and
the memory model must agree with the runtime's measured peak (a deterministic count of live
tensor bytes) within 15% on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medley.profile.fidelity import FidelityCase
from medley.profile.harness import TINY, harness_steps, run_harness


@pytest.mark.timeout(150)
def test_two_plans_predicted_and_measured(tmp_path: Path) -> None:
    cases = [
        FidelityCase(name="pp2", model=TINY, pp=2, dp=1, split="2,2", zero="0,0", seq_len=32),
        FidelityCase(name="dp2-zero3", model=TINY, pp=1, dp=2, zero="3", seq_len=32, micro_batches="3"),
    ]
    steps: list[str] = []
    results = run_harness(cases, tmp_path, name="quick", steps=4, comm_sizes=(4096, 65536),
                          progress=steps.append)
    assert len(steps) == harness_steps(cases) and steps[-1].startswith("dp2-zero3")  # `fidelity` shows these
    assert [r.case for r in results] == ["pp2", "dp2-zero3"]
    for r in results:
        assert r.predicted_step_s > 0 and r.fastest_step_s > 0 and r.measured_step_s >= r.fastest_step_s
        assert r.cost_source == "profile:profile-cpu-tiny.json"
        assert sorted(r.measured_memory) == sorted(r.predicted_memory) == [0, 1]
        for device, error in r.memory_errors.items():
            assert abs(error) < 0.15, f"{r.case} device {device}: memory off by {error:+.1%}"
    report = json.loads((tmp_path / "quick.json").read_text())
    assert report["summary"]["cases"] == 2 and len(report["results"]) == 2
    assert "| pp2 |" in (tmp_path / "quick.md").read_text()
    profile = json.loads((tmp_path / "profile-cpu-tiny.json").read_text())
    assert profile["comm"]["link_by_ranks"].keys() == {"2"}
