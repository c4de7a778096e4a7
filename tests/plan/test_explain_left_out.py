"""``plan --explain`` says what the best plan forgoes (issue 44): the devices it leaves idle, with the
fastest plan that uses every device and where that plan's time goes; and, where a device type
without bf16 makes the plan fp16, the fastest plan in bf16 (which leaves that type out). A plan
the search did not simulate is simulated for the line, and the line says so."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from medley.search.planner import Constraints, SearchResult, search
from medley.search.report.explain import explain, left_out
from medley.spec.cluster_load import load_cluster, parse_cluster_arg
from medley.spec.model_arg import get_model

SEVEN_B = get_model("llama-2-7b")


def lab(directory: Path, gbps: float) -> Path:
    """Two A100s in one node and a T4 in another, over a link of ``gbps`` GB/s."""
    path = directory / f"lab-{gbps}.toml"
    path.write_text('name = "lab"\n'
                    '[[nodes]]\nname = "a"\ndevice = "A100-80GB"\ncount = 2\n'
                    '[[nodes]]\nname = "t"\ndevice = "T4-16GB"\ncount = 1\n'
                    f'[[tiers]]\nname = "slow"\nbandwidth_gbps = {gbps}\nlatency_us = 200\n')
    return path


def planned(cluster) -> SearchResult:  # noqa: ANN001 - a Cluster
    return search(cluster, SEVEN_B, global_batch=64, seq_len=2048, baselines=False)


def seconds(line: str) -> float:
    return float(re.search(r"takes ([0-9.]+) s \(\+", line)[1])


def test_an_idle_device_is_named_with_the_plan_that_uses_it(tmp_path: Path) -> None:
    result = planned(load_cluster(lab(tmp_path, 0.15)))
    assert set(result.best.plan.devices) == {0, 1}  # the T4, behind a slow link, is left out
    [line] = left_out(result)
    assert line.startswith("Idle: device 2 (T4-16GB) left out by this plan; the fastest plan simulated that "
                           "uses every device takes ")
    assert "communication exposed" in line and seconds(line) > result.best.prediction.step_time_s
    assert line.endswith("; its devices span tier 'slow' (0.15 GB/s), this plan's stay on one node.")
    assert line in explain(result).lines()
    # the same line when the search had simulated no such plan: one is simulated for it
    alone = dataclasses.replace(result, simulated=[result.best])
    [again] = left_out(alone)
    assert "best-estimated plans that uses every device (simulated for this line) takes " in again
    assert seconds(again) > result.best.prediction.step_time_s


def test_an_idle_device_whose_plans_were_all_ruled_out_says_so(tmp_path: Path) -> None:
    result = planned(load_cluster(lab(tmp_path, 0.05)))
    assert left_out(result) == [
        "Idle: device 2 (T4-16GB) left out by this plan; the search estimated no plan that uses every "
        "device: its bounds ruled them out (memory, or a step no faster than those it kept)."]


def test_bf16_forgone_for_a_device_without_it_is_weighed() -> None:
    result = planned(parse_cluster_arg("4xA100-80GB+1xT4-16GB"))
    assert result.best.plan.shared.dtype == "fp16" and len(result.best.plan.devices) == 5
    [line] = left_out(result)
    assert line.startswith("bf16: T4-16GB made this plan fp16; the fastest plan simulated in bf16 "
                           "(without it), on 4 devices, takes ")
    assert seconds(line) >= result.best.prediction.step_time_s


def test_nothing_is_said_where_nothing_is_forgone() -> None:
    result = planned(parse_cluster_arg("2xA100-80GB"))
    assert result.best.plan.shared.dtype == "bf16" and len(result.best.plan.devices) == 2
    assert left_out(result) == []


def test_no_bf16_line_when_plan_dtype_chose_the_precision() -> None:
    result = search(parse_cluster_arg("4xA100-80GB+1xT4-16GB"), SEVEN_B, global_batch=64, seq_len=2048,
                    baselines=False, constraints=Constraints(dtype="fp16"))
    assert not [line for line in left_out(result) if line.startswith("bf16")]
