"""What a ZeRO level means, once: the schedule places it, the compiler times and sizes it, the
runtime executes it.

Each stage is its own ZeRO group: its devices in every replica (``dp`` of them). The schedule's
collective actions (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``, ``OPTIM``) mean, per level:

====== ================ ========================= ================ =======================
level  between steps,   REDUCE_GRAD (after the    OPTIM            UNSHARD / RESHARD
       sharded over dp  bucket's last W)
====== ================ ========================= ================ =======================
0      nothing          all-reduce of gradients   whole step       none
1      optimizer state  reduce-scatter (once      step on the      UNSHARD after OPTIM:
                        per step)                 shard            all-gather of the
                                                                   updated weights
2      + gradients      reduce-scatter (per       step on the      as level 1
                        gradient window)          shard
3      + weights        reduce-scatter (per       step on the      UNSHARD before compute:
                        gather round)             shard            all-gather; RESHARD after
====== ================ ========================= ================ =======================

Levels 1 and 2 are the distributed optimizer of Megatron-LM and DeepSpeed: reduce-scatter the
gradient, step the shard, all-gather the updated weights, the same bytes as level 0's
all-reduce. Level 1 differs from 2 only in holding the gradient accumulation whole all step (one
reduction per step) instead of sharding it with more reductions. The runtime runs levels 1-3 as
FSDP2 units (one per bucket): one flat collective per bucket, not one per tensor.

Bytes per parameter come from :func:`medley.cost.zero_memory.state_bytes_per_param`: weights are
gathered in the weights' dtype, gradients reduced in the gradients'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from medley.cost.interfaces import Collective


class Payload(StrEnum):
    """What a collective moves: the stage's weights or its gradients."""

    WEIGHTS = "weights"
    GRADS = "grads"


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroLevel:
    """The meaning of one ZeRO level.

    Attributes:
        level: 0..3.
        shards_optimizer / shards_grads / shards_weights: which model state is sharded over the
            stage's dp group between steps (the memory model reads these); with the optimizer
            sharded each member steps only its shard, and the runtime holds the parameters as
            FSDP2 shards.
        reduction: the collective of ``REDUCE_GRAD``.
        gradient_windows: whether a step may reduce several times (sharding the accumulation):
            level 2's ``grad_windows``; level 3 reduces once per gather round.
        gathers_for_compute: ``UNSHARD`` gathers the weights before compute and ``RESHARD``
            frees them after (level 3).
        gathers_after_step: an ``UNSHARD`` after each bucket's ``OPTIM`` all-gathers the weights
            each member updated a shard of (levels 1-2).
    """

    level: int
    shards_optimizer: bool
    shards_grads: bool
    shards_weights: bool
    reduction: Collective
    gradient_windows: bool
    gathers_for_compute: bool
    gathers_after_step: bool

    def collective(self, kind: str) -> tuple[Collective | None, Payload | None]:
        """The collective and payload of a schedule action of ``kind`` (``UNSHARD``,
        ``RESHARD``, ``REDUCE_GRAD`` or ``OPTIM``) on a stage of this level; ``(None, None)``
        for one that moves no bytes."""
        if kind == "UNSHARD" and (self.gathers_for_compute or self.gathers_after_step):
            return Collective.ALL_GATHER, Payload.WEIGHTS
        if kind == "REDUCE_GRAD":
            return self.reduction, Payload.GRADS
        return None, None


ZERO_LEVELS: dict[int, ZeroLevel] = {
    0: ZeroLevel(level=0, shards_optimizer=False, shards_grads=False, shards_weights=False,
                 reduction=Collective.ALL_REDUCE, gradient_windows=False, gathers_for_compute=False,
                 gathers_after_step=False),
    1: ZeroLevel(level=1, shards_optimizer=True, shards_grads=False, shards_weights=False,
                 reduction=Collective.REDUCE_SCATTER, gradient_windows=False, gathers_for_compute=False,
                 gathers_after_step=True),
    2: ZeroLevel(level=2, shards_optimizer=True, shards_grads=True, shards_weights=False,
                 reduction=Collective.REDUCE_SCATTER, gradient_windows=True, gathers_for_compute=False,
                 gathers_after_step=True),
    3: ZeroLevel(level=3, shards_optimizer=True, shards_grads=True, shards_weights=True,
                 reduction=Collective.REDUCE_SCATTER, gradient_windows=True, gathers_for_compute=True,
                 gathers_after_step=False),
}


def zero_level(level: int) -> ZeroLevel:
    """The meaning of ZeRO ``level``; a ValueError names the allowed levels."""
    try:
        return ZERO_LEVELS[level]
    except KeyError:
        raise ValueError(f"ZeRO level must be 0, 1, 2 or 3, got {level}") from None


def fsdp_units(level: int, dp: int) -> bool:
    """Whether a stage of ZeRO ``level`` on a dp group of ``dp`` runs as FSDP2 units (levels 1-3):
    with one replica there is nothing to shard and it runs as level 0 (as torchtitan applies FSDP
    only when its shard degree exceeds 1). The runtime builds stages, and the memory model and the
    simulator book them, by this."""
    return dp > 1 and zero_level(level).shards_optimizer


def tied_sum_by_rows(zero: Sequence[int], dp: int) -> bool:
    """Whether the tied gradients are summed by rows: each member of the first or the last stage's
    dp group sums only its shard's rows (that end runs as FSDP2 units, :func:`fsdp_units`), the
    other end then gathering the summed rows. The runtime sums exactly as this says."""
    return fsdp_units(zero[0], dp) or fsdp_units(zero[-1], dp)
