"""Garbage collection runs between steps only, every ``gc_every`` steps, and is given back."""

from __future__ import annotations

import gc

import pytest

from medley.runtime.collector import StepGarbageCollector


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _cycles_alive() -> int:
    return sum(type(o) is _Cycle for o in gc.get_objects())


@pytest.mark.parametrize("every", [1, 3])
def test_cycles_wait_for_the_step_boundary(every: int) -> None:
    assert gc.isenabled()
    collector = StepGarbageCollector(every)
    collector.start()
    try:
        assert not gc.isenabled()
        for step in range(every):
            for _ in range(2000):  # enough allocations to trigger automatic collection many times
                _Cycle()
            assert _cycles_alive() >= 2000 * (step + 1)
            collector.after_step(step)
        assert _cycles_alive() == 0
    finally:
        collector.stop()
    assert gc.isenabled()


def test_zero_leaves_the_collector_automatic() -> None:
    collector = StepGarbageCollector(0)
    collector.start()
    assert gc.isenabled()
    collector.stop()
    assert gc.isenabled()
