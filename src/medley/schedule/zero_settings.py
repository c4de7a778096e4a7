"""ZeRO settings of a pipeline stage and the collective placement policies (what
:mod:`medley.schedule.zero` places)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from medley.cost.zero_levels import zero_level


class Placement(StrEnum):
    NAIVE = "naive"
    BUBBLE = "bubble"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageZero:
    """ZeRO settings of one pipeline stage.

    Attributes:
        level: ZeRO level 0..3.
        buckets: layer buckets the stage's collectives are split into (bubble policy).
        gather_windows: level 3: gather/reshard rounds per step; 1 keeps the weights gathered
            from first to last use in the step; 0 streams them: every compute action gathers
            its buckets before it and frees them after it, and reduce-scatters its gradient
            after every action that makes one (no unsharded accumulation across actions). A
            compute action is one autograd call over the stage, so it holds all its buckets
            gathered (medley.cost.zero_memory); the buckets split the collectives. Each round
            ends with its gradient reduce-scatter, so more rounds also shard the gradient
            accumulation.
        grad_windows: level 2: reduce-scatters per step; 1 accumulates a full gradient and
            reduces it once, more shard the accumulation (less memory, more traffic).
    """

    level: int
    buckets: int = 1
    gather_windows: int = 1
    grad_windows: int = 1

    @property
    def streams(self) -> bool:
        return zero_level(self.level).gathers_for_compute and self.gather_windows == 0

    def __post_init__(self) -> None:
        zero_level(self.level)  # a ValueError names the levels
        if self.gather_windows < 0:
            raise ValueError(f"gather_windows must be >= 0, got {self.gather_windows}")
        for name in ("buckets", "grad_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
