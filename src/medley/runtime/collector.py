"""Python's cyclic garbage collector runs between steps, not in the middle of one.

Left automatic, the collector starts whenever allocations cross its thresholds, which in a
training step is at a random action on a random rank; every other rank of the pipeline then
waits for it, so one rank's pause costs the step. As torchtitan does (``gc_freq``), collection
is switched off while training and run every few steps at the step boundary, on every rank
alike. Reference counting still frees almost every tensor at once; only cycles wait.
"""

from __future__ import annotations

import gc


class StepGarbageCollector:
    """For a training loop: :meth:`start` switches automatic collection off, :meth:`after_step`
    runs one young-generation pass (1) every ``every`` steps, :meth:`stop` restores the collector
    as it was; ``every`` 0 leaves it automatic."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.every:
            gc.collect()  # what setup left behind, once
            gc.disable()

    def after_step(self, step: int) -> None:
        """Called after step ``step`` (0-based) ends, outside its timed part."""
        if self.every and (step + 1) % self.every == 0:
            gc.collect(1)

    def stop(self) -> None:
        if self.every and self.was_enabled:
            gc.enable()
