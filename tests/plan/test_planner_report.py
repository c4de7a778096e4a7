"""The planner benchmark's Markdown reads every figure of its summary from the data."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from medley.search.rank.baselines import NAMES
from medley.search.report.ablation import STEPS

_SPEC = importlib.util.spec_from_file_location(
    "planner_report", Path(__file__).parents[2] / "bench" / "planner_report.py"
)
assert _SPEC is not None and _SPEC.loader is not None
report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(report)


def _row(devices: int, ratio: float, share: float) -> dict:
    return {
        "devices": devices, "types": 2, "model": "m", "fits": True, "search_cpu_s": 1.0, "simulated": 3,
        "plan": "p", "tokens_per_s": 10.0, "step_time_s": 1.0, "aggregate_fraction": 0.5 + devices / 1000,
        "baselines": dict.fromkeys(NAMES, "b"), "versus": dict.fromkeys(NAMES, ratio),
        "provenance": {"commit": "abc", "command": "c"},
        "ablation": {"best_baseline": NAMES[0], "best_baseline_step_time_s": ratio,
                     "steps": {s: {"step_time_s": 1.1, "share_of_gain": share, "plan": "p", "note": ""}
                               for s in STEPS}},
    }


def test_summary_is_computed_from_the_rows() -> None:
    data = {
        "machine": "x",
        "search": [_row(16, 1.2, 0.5), _row(64, 1.4, 0.1), _row(128, 1.25, 0.3),
                   {"devices": 64, "types": 4, "model": "old", "fits": True, "search_cpu_s": 1.0,
                    "simulated": 1, "plan": "p", "tokens_per_s": 1.0, "aggregate_fraction": 0.9,
                    "versus": {"metis-style": 9.0}}],
        "pruning": [{"loss_from_pruning": 0.01}, {"loss_from_pruning": 0.03}],
    }
    lines = report.summary(data)
    expected = (f"- vs {NAMES[0]}: median 1.25x, least 1.20x, most 1.40x over 3 cases "
                "(0 where it fits nowhere).")
    assert expected in lines
    assert f"- Goal >= 1.3x {NAMES[0]} on every mixed case of >= 64 devices: met on 1 of 2" in " ".join(lines)
    # 1.3 x 0.628 / 1.25: the fraction of the bound that 1.3x would take, against the plan's
    missed = ("  - missed at 128 devices, m: 1.250x; 1.3x needs 65.3% of the aggregate bound, the plan "
              "reaches 62.8%.")
    assert missed in lines
    assert any(line.startswith(f"- Taking away {STEPS[0]} alone") and "median 30%" in line for line in lines)
    assert "- Loss from pruning against the reference search: median 2.0%, worst 3.0% over 2 cases." in lines
    text = report.markdown({**data, "pruning": []})
    assert "9.00" not in text  # the old row's ratio, measured with the former baselines, is not shown
    assert "1 rows (64 devices) are from before the baselines" in text


def test_a_best_plan_taken_from_a_baseline_is_said() -> None:
    bound = {"case": "c", "model": "m", "samples_per_device": 1, "global_batch": 16, "tokens_per_s": 2.0,
             "aggregate_tokens_per_s": 4.0, "aggregate_fraction": 0.5, "versus_best_baseline": 1.0,
             "best_baseline": "fastest-type-only", "best_plan": "fastest-type-only pp=2 dp=4 zb-h1 mbs=1"}
    own = {**bound, "samples_per_device": 2, "best_plan": "all pp=4 dp=4 zb-h1 mbs=1"}
    lines = report.summary({"bound": [bound, own]})
    taken = [line for line in lines if line.startswith("- Taken from a baseline")]
    assert len(taken) == 1 and "1 samples per device" in taken[0] and "fastest-type-only's" in taken[0]
