"""The README's measured figures are the ones the benchmarks wrote (prose figures come from data):
the demo's times from bench/results/demo_time.json, the dry run's from check_dry_run.json."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_demo_times_are_the_measured_ones() -> None:
    data = json.loads((ROOT / "bench" / "results" / "demo_time.json").read_text())
    median = data["median"]
    said = (f"{median['wall_s']} s measured by `bench/demo_time.py` with `scripts/demo.sh`, of which about "
            f"{median['hf_part_s']} s is the Hugging Face part, `--hf-steps 0` skips it; about "
            f"{median['without_training_s']} s without the real CPU runs")
    assert said in one_line(README)


def test_the_dry_run_cpu_time_is_the_measured_one() -> None:
    data = json.loads((ROOT / "bench" / "results" / "check_dry_run.json").read_text())
    said = (f"The 1,024-device 70B plan ({data['world_size']} ranks, {data['ranks_built']} built) took "
            f"{data['wall_s']:.0f} s wall clock, {data['cpu_s']:.0f} s of CPU")
    assert said in one_line(README)


def test_the_published_runs_errors_are_the_measured_ones() -> None:
    halves = json.loads((ROOT / "bench" / "results" / "published.json").read_text())["summary"]["by_half"]
    held, fit = halves["held_out"], halves["calibration"]
    said = (f"fitted on the {fit['rows']} rows of the calibration half (`bench/published_fit.py`); on the "
            f"{held['rows']} held-out rows the median error is {100 * held['median_abs_error']:.1f}% and the "
            f"worst {100 * held['worst_abs_error']:.1f}% (calibration half: "
            f"{100 * fit['median_abs_error']:.1f}%, worst {100 * fit['worst_abs_error']:.1f}%;")
    assert said in one_line(README)
