"""Selective and per-block recomputation equal single-process training (no recomputation): loss and
gradients within 1e-5 (fp32), parameters after SGD steps within 1e-5, on gloo: pipelines under
1F1B and under the split backward of ZB-H1 (B and W each rerun a block: selective recomputation's
saved outputs are read twice), ZeRO-3 replicas, interleaved chunks and tensor parallelism.
Each case checks that blocks did rerun their forward (else equality would hold without any
recomputation).

One launch per world size runs all of its cases (a launch costs seconds).
"""

from __future__ import annotations

import pytest
from equality_worker import Case
from test_equality import check, launch, zb_h1

from medley.schedule.generators import generate


def check_reruns(results: dict[str, dict], cases: list[Case]) -> None:
    check(results, cases)
    for case in cases:
        figures = results[case.name]
        assert figures["reruns"] > 0, f"{case.name}: no block reran its forward: {figures}"


def two_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="pp2-1f1b-selective", pp=2, dp=1, split=(3, 3), zero=(0, 0),
             recompute=("selective", "selective"), schedules=[gen("1f1b", pp=2, micro_batches=3)]),
        Case(name="pp2-1f1b-full:1,selective:1", pp=2, dp=1, split=(2, 4), zero=(0, 0),
             recompute=("full:1", "selective:1"), schedules=[gen("1f1b", pp=2, micro_batches=3)]),
        Case(name="pp2-zbh1-zero3-selective:1,full:1", pp=2, dp=1, split=(3, 3), zero=(3, 3),
             recompute=("selective:1", "full:1"), schedules=[zb_h1(2, 4)]),
        Case(name="pp2-zbh1-selective", pp=2, dp=1, split=(3, 3), zero=(0, 0),
             recompute=("selective", "selective"), schedules=[zb_h1(2, 3)]),
        Case(name="dp2-zero3-selective", pp=1, dp=2, split=(6,), zero=(3,), recompute=("selective",),
             schedules=[gen("gpipe", pp=1, micro_batches=3), gen("gpipe", pp=1, micro_batches=1)]),
        Case(name="tp2-selective:2", pp=1, dp=1, tp=(2,), split=(6,), zero=(0,), recompute=("selective:2",),
             schedules=[gen("1f1b", pp=1, micro_batches=2)]),
    ]


@pytest.mark.timeout(300)
def test_two_ranks(tmp_path) -> None:
    cases = two_rank_cases()
    check_reruns(launch(2, cases, tmp_path), cases)


def four_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="pp2xdp2-interleaved-selective,full:1", pp=2, dp=2, split=(1, 2, 2, 1), zero=(3, 1, 0, 2),
             recompute=("selective", "full:1", "selective:1", "none"),
             schedules=[gen("interleaved", pp=2, micro_batches=4)] * 2),
        Case(name="pp2-tp2-selective,full:1", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(0, 0),
             recompute=("selective", "full:1"), schedules=[gen("1f1b", pp=2, micro_batches=3)]),
    ]


@pytest.mark.timeout(300)
def test_four_ranks(tmp_path) -> None:
    cases = four_rank_cases()
    check_reruns(launch(4, cases, tmp_path), cases)
