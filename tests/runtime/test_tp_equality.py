"""Tensor parallelism equals single-process training: loss and gradients within 1e-5 (fp32),
parameters after SGD steps within 1e-5, on gloo with 2-4 ranks: TP alone, TP x pipeline, TP x dp
under ZeRO, stages of unlike TP degrees in one replica (pipeline hops between TP groups of 2 and
1, both ways) and interleaved stages on TP groups.

One launch per world size runs all of its cases (a launch costs seconds).
"""

from __future__ import annotations

import pytest
from equality_worker import Case
from test_equality import check, launch, zb_h1

from medley.schedule.generators import generate


def check_tp(results: dict[str, dict], cases: list[Case]) -> None:
    """Equality (:func:`test_equality.check`), and every rank of degree above 1 held its blocks'
    linear weights TP-sharded (else equality would hold without any TP)."""
    check(results, cases)
    for case in cases:
        figures = results[case.name]
        assert figures["tp_missing"] == 0 and figures["tp_sharded"] > 0, f"{case.name}: no TP: {figures}"


def two_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="tp2-1f1b-zero0", pp=1, dp=1, tp=(2,), split=(6,), zero=(0,),
             schedules=[gen("1f1b", pp=1, micro_batches=3)]),
        Case(name="tp2-gpipe-zero3", pp=1, dp=1, tp=(2,), split=(6,), zero=(3,),
             schedules=[gen("gpipe", pp=1, micro_batches=2)]),
    ]


@pytest.mark.timeout(240)
def test_tp2(tmp_path) -> None:
    cases = two_rank_cases()
    check_tp(launch(2, cases, tmp_path), cases)


def three_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="pp2-tp2,1-1f1b-zero0,3", pp=2, dp=1, tp=(2, 1), split=(3, 3), zero=(0, 3),
             schedules=[gen("1f1b", pp=2, micro_batches=4)]),
        Case(name="pp2-tp1,2-1f1b-zero1,0", pp=2, dp=1, tp=(1, 2), split=(2, 4), zero=(1, 0),
             schedules=[gen("1f1b", pp=2, micro_batches=3)]),
        Case(name="pp2-tp2,1-interleaved-zero0,2,3,0", pp=2, dp=1, tp=(2, 1), split=(1, 2, 2, 1),
             zero=(0, 2, 3, 0), schedules=[gen("interleaved", pp=2, micro_batches=4)]),
    ]


@pytest.mark.timeout(300)
def test_unlike_tp_degrees_in_one_replica(tmp_path) -> None:
    cases = three_rank_cases()
    check_tp(launch(3, cases, tmp_path), cases)


def four_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="tp2xpp2-1f1b-zero0,1", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(0, 1),
             schedules=[gen("1f1b", pp=2, micro_batches=4)]),
        Case(name="tp2xdp2-zero3-uneven-mb", pp=1, dp=2, tp=(2,), split=(6,), zero=(3,),
             schedules=[gen("gpipe", pp=1, micro_batches=3), gen("gpipe", pp=1, micro_batches=1)]),
        Case(name="tp2xdp2-1f1b-zero0", pp=1, dp=2, tp=(2,), split=(6,), zero=(0,),
             schedules=[gen("1f1b", pp=1, micro_batches=2)] * 2),
        Case(name="tp2xpp2-interleaved-zero0,3,1,2", pp=2, dp=1, tp=(2, 2), split=(1, 2, 2, 1),
             zero=(0, 3, 1, 2), schedules=[gen("interleaved", pp=2, micro_batches=4)]),
        Case(name="tp2xpp2-zbh1-zero3,0", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(3, 0),
             schedules=[zb_h1(2, 4)]),
        Case(name="tp2xdp2-1f1b-zero2-uneven-mb", pp=1, dp=2, tp=(2,), split=(6,), zero=(2,),
             schedules=[gen("1f1b", pp=1, micro_batches=1), gen("1f1b", pp=1, micro_batches=3)]),
        # TP groups not in rank order: TP rank 0 of pipeline rank 0 is global rank 3.
        Case(name="tp2xpp2-1f1b-zero1,3-assignment-3,2;1,0", pp=2, dp=1, tp=(2, 2), split=(2, 4),
             zero=(1, 3), schedules=[gen("1f1b", pp=2, micro_batches=3)], table=(((3, 2), (1, 0)),)),
        Case(name="tp2xdp2-zero1-assignment-2,1;3,0", pp=1, dp=2, tp=(2,), split=(6,), zero=(1,),
             schedules=[gen("gpipe", pp=1, micro_batches=2)] * 2, table=(((2, 1),), ((3, 0),))),
    ]


@pytest.mark.timeout(300)
def test_tp2_with_pipeline_and_data_parallel(tmp_path) -> None:
    cases = four_rank_cases()
    check_tp(launch(4, cases, tmp_path), cases)


def sequence_parallel_cases() -> list[Case]:
    """Sequence parallelism: tp2 x pp2, the hop between the groups carrying sequence shards (both
    sides end and start with blocks), also split and interleaved; then a stage that starts
    with the embedding and one that ends on the head (shards cut and gathered inside a stage)."""
    gen = generate
    return [
        Case(name="sp-tp2xpp2-1f1b-zero0,1", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(0, 1),
             schedules=[gen("1f1b", pp=2, micro_batches=4)], sequence_parallel=True),
        Case(name="sp-tp2xpp2-zbh1-zero3,0", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(3, 0),
             schedules=[zb_h1(2, 4)], sequence_parallel=True),
        Case(name="sp-tp2xpp2-interleaved-zero0,3,1,2", pp=2, dp=1, tp=(2, 2), split=(1, 2, 2, 1),
             zero=(0, 3, 1, 2), schedules=[gen("interleaved", pp=2, micro_batches=4)],
             sequence_parallel=True),
        Case(name="sp-tp2xdp2-zero2", pp=1, dp=2, tp=(2,), split=(6,), zero=(2,),
             schedules=[gen("1f1b", pp=1, micro_batches=2)] * 2, sequence_parallel=True),
        # ZeRO-0: the norms' partial gradients summed over TP before the DP all-reduce.
        Case(name="sp-tp2xdp2-zero0", pp=1, dp=2, tp=(2,), split=(6,), zero=(0,),
             schedules=[gen("1f1b", pp=1, micro_batches=2)] * 2, sequence_parallel=True),
        # With recomputation: a selective block reruns its sequence-parallel norms and gathers; a
        # full one keeps its input shard (and a split backward reruns it twice).
        Case(name="sp-tp2xpp2-selective", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(0, 0),
             schedules=[gen("1f1b", pp=2, micro_batches=4)], sequence_parallel=True,
             recompute=("selective", "selective")),
        Case(name="sp-tp2xpp2-zbh1-full:1-selective:1", pp=2, dp=1, tp=(2, 2), split=(3, 3), zero=(1, 3),
             schedules=[zb_h1(2, 4)], sequence_parallel=True, recompute=("full:1", "selective:1")),
    ]


@pytest.mark.timeout(300)
def test_sequence_parallel_tp2_pp2(tmp_path) -> None:
    cases = sequence_parallel_cases()
    check_tp(launch(4, cases, tmp_path), cases)
