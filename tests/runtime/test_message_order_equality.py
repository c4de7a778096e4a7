"""Pipelines whose ranks exchange several kinds of message train equal to one process when
transfers are matched by their order alone, as NCCL matches them.

The executor posts every transfer untagged (gloo then matches a rank pair's messages in order, as
NCCL does), so these runs would swap tensors if a pair received in another order than it sent:
the last case runs medley's former lowering (each receive right before its consumer) and must
come out wrong, which shows the transport really ignores tags.
"""

from __future__ import annotations

import pytest
from equality_worker import Case
from test_equality import TOL, check, launch

from medley.schedule.generators import generate


def two_rank_cases() -> list[Case]:
    return [
        Case(name="pp2-interleaved-v2-m5", pp=2, dp=1, split=(1, 2, 2, 1), zero=(0, 0, 0, 0),
             schedules=[generate("interleaved", pp=2, micro_batches=5, virtual_stages=2)]),
        Case(name="pp2-interleaved-v2-m6-zero3", pp=2, dp=1, split=(1, 2, 2, 1), zero=(3, 3, 3, 3),
             schedules=[generate("interleaved", pp=2, micro_batches=6, virtual_stages=2)]),
        Case(name="pp2-interleaved-v3-m5", pp=2, dp=1, split=(1,) * 6, zero=(0,) * 6,
             schedules=[generate("interleaved", pp=2, micro_batches=5, virtual_stages=3)]),
        Case(name="pp2-zbh1-m5", pp=2, dp=1, split=(3, 3), zero=(0, 0),
             schedules=[generate("zb-h1", pp=2, micro_batches=5)]),
    ]


def three_rank_cases() -> list[Case]:
    return [
        Case(name="pp3-interleaved-v2-m4", pp=3, dp=1, split=(1,) * 6, zero=(0,) * 6,
             schedules=[generate("interleaved", pp=3, micro_batches=4, virtual_stages=2)]),
        Case(name="pp3-interleaved-v2-m5", pp=3, dp=1, split=(1,) * 6, zero=(1, 0, 3, 0, 2, 0),
             schedules=[generate("interleaved", pp=3, micro_batches=5, virtual_stages=2)]),
        Case(name="pp3-hetero-1f1b-m5", pp=3, dp=1, split=(2, 2, 2), zero=(0, 0, 0),
             schedules=[generate("hetero-1f1b", pp=3, micro_batches=5, warmup=(5, 3, 1))]),
    ]


@pytest.mark.timeout(300)
def test_two_ranks_in_order(tmp_path) -> None:
    cases = two_rank_cases()
    check(launch(2, cases, tmp_path), cases)


@pytest.mark.timeout(300)
def test_three_ranks_in_order(tmp_path) -> None:
    cases = three_rank_cases()
    check(launch(3, cases, tmp_path), cases)


@pytest.mark.timeout(300)
def test_the_former_lowering_swaps_tensors_without_tags(tmp_path, former_lowering) -> None:
    """Interleaved pp 2, 5 micro-batches: rank 1 used to receive the activation of micro-batch 3
    where rank 0 sends a gradient; without tags the two tensors (one shape) trade places."""
    schedule = former_lowering(generate("interleaved", pp=2, micro_batches=5, virtual_stages=2))
    case = Case(name="former-lowering", pp=2, dp=1, split=(1, 2, 2, 1), zero=(0, 0, 0, 0),
                schedules=[schedule])
    figures = launch(2, [case], tmp_path)["former-lowering"]
    assert "error" not in figures, figures
    assert max(figures["loss"], figures["grad"]) > 1e3 * TOL, figures
