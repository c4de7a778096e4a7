"""The fidelity harness end to end on two plans of the planner's regime (clipping; ZeRO-1 with
layer buckets, the planner's first choice for two CPU ranks): profile (with the runtime's
overhead), simulate, train for real, report.

No end-to-end step-time bound here: how close the prediction comes to this machine's measured
step is the fidelity goal, and goals are bench/fidelity.py's (on this 2-core CPU the quiet-run
errors of these two plans measured -25% to -54% and -65%, and they move with whatever else runs:
a bound in CI either fails at random or has to be skipped under load, which hides a real
failure). What is checked instead does not depend on the machine's speed: each timed step is
replayed in the simulator on its own measured compute durations, and the median replay error of
each plan stays within 50% (a simulator that drops a dependency, a transfer or the overhead, or
mixes units, fails it; the bench's worst case over 40 plans is 27.5%). Peak memory, a
deterministic count of live tensor bytes, must agree within 5% (the issue's goal) on every rank
of both plans.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medley.fidelity.harness import TINY, harness_steps, run_harness
from medley.fidelity.plans import FidelityCase
from medley.fidelity.results import memory_failure

REPLAY_BOUND = 0.5  # median |replay error| per plan (see the module docstring)
MEMORY_BOUND = 0.05  # the goal


@pytest.mark.timeout(600)
def test_two_plans_predicted_and_measured(tmp_path: Path) -> None:
    cases = [
        FidelityCase(
            name="pp2-clip", model=TINY, pp=2, dp=1, split="2,2", zero="0,0", seq_len=32, clip_grad=True
        ),
        FidelityCase(
            name="dp2-zero1-b4",
            model=TINY,
            pp=1,
            dp=2,
            zero="1",
            buckets=4,
            seq_len=32,
            micro_batches="3",
            clip_grad=True,
        ),
    ]
    steps: list[str] = []
    results = run_harness(
        cases, tmp_path, name="quick", steps=6, comm_sizes=(4096, 65536), progress=steps.append
    )
    assert len(steps) == harness_steps(cases) and steps[-1].startswith("dp2-zero1")  # `fidelity` shows these
    assert [r.case for r in results] == ["pp2-clip", "dp2-zero1-b4"]
    for r in results:
        assert r.predicted_step_s > 0 and r.fastest_step_s > 0 and r.measured_step_s >= r.fastest_step_s
        assert r.cost_source == "profile:profile-cpu-tiny.json"
        assert sorted(r.measured_memory) == sorted(r.predicted_memory) == [0, 1]
        assert r.predicted_step_s >= r.predicted_no_overhead_s  # the overhead only adds (0 if none measured)
        assert r.breakdown["compute_actions"] > 0 and "clip" in r.tags
    # The one memory model says what the runtime holds: FSDP2's shards, the gradient the backward
    # makes, the reduce-scatter's buffers, the activations the profile measured exactly, and on
    # the pipeline's last stage one micro-batch's received input (the executor lets each go).
    assert memory_failure(results, bound=MEMORY_BOUND) is None
    report = json.loads((tmp_path / "quick.json").read_text())
    assert report["summary"]["cases"] == 2 and len(report["results"]) == 2
    assert report["meta"]["overhead"]["tiny"]["figures"]["slope_per_micro_batch_s"] > 0
    assert "| pp2-clip |" in (tmp_path / "quick.md").read_text()
    profile = json.loads((tmp_path / "profile-cpu-tiny.json").read_text())
    assert profile["comm"]["link_by_ranks"].keys() == {"2"}
    assert profile["overhead"]["figures"]["probe_layers_s"] > 0
    assert profile["overhead"]["figures"]["zero3_slope_per_micro_batch_s"] > 0
    blocks = [m for m in profile["layers"] if m["kind"] == "block"]
    assert blocks and all(m["tp_forward_s"] > 0 and m["tp_backward_full_s"] > 0 for m in blocks)
    for r in results:  # the simulator's model of the step around measured compute
        errors = sorted(abs(e) for e in r.replay_errors)
        assert len(errors) >= 3, f"{r.case}: {len(errors)} steps replayed"
        assert errors[len(errors) // 2] <= REPLAY_BOUND, f"{r.case}: replay errors {errors}"
