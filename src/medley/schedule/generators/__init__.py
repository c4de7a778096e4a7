"""Schedule generators: one function per family, all reachable through :func:`generate`.

Every generator returns a compute-only :class:`~medley.schedule.ir.PipelineSchedule` (lower it
with :func:`~medley.schedule.ir.add_send_recv`). Knobs are integers or tuples of integers so the
planner can search them; ``stage_costs`` and ``memory_limit`` are inputs, not knobs, and only the
cost-driven families (``zb-h2``, ``bidirectional``) use them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from medley.schedule.generators.bidirectional import bidirectional
from medley.schedule.generators.classic import gpipe, hetero_one_f_one_b, interleaved, one_f_one_b
from medley.schedule.generators.zero_bubble import zb_h1, zb_h2
from medley.schedule.ir import PipelineSchedule

_GENERATORS: dict[str, Callable[..., PipelineSchedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "hetero-1f1b": hetero_one_f_one_b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "bidirectional": bidirectional,
}

FAMILIES: tuple[str, ...] = tuple(_GENERATORS)


def generate(family: str, *, pp: int, micro_batches: int, **knobs: Any) -> PipelineSchedule:
    """Build the schedule of ``family`` for ``pp`` ranks and ``micro_batches`` micro-batches.

    Knobs per family: ``interleaved``: ``virtual_stages``; ``hetero-1f1b``: ``warmup`` (one depth
    per stage); ``zb-h2``: ``stage_costs``, ``memory_limit``; ``bidirectional``:
    ``down_micro_batches``, ``stage_costs``, ``memory_limit``.
    """
    try:
        generator = _GENERATORS[family]
    except KeyError:
        raise ValueError(f"unknown schedule family {family!r}; expected one of {list(FAMILIES)}") from None
    # Generators are deterministic: a search asks for the same few programs again and again (each
    # replica's count, each placement policy, the interleaved memory rule). Each caller gets its
    # own rows (the actions themselves are immutable, and so are the knobs' values).
    key = (family, pp, micro_batches, repr(sorted(knobs.items())))
    made = _MADE.get(key)
    if made is None:
        try:
            made = generator(pp=pp, micro_batches=micro_batches, **knobs)
        except TypeError as err:
            if "unexpected keyword" in str(err):
                message = f"schedule family {family!r} does not take knob(s) {sorted(knobs)}: {err}"
                raise ValueError(message) from None
            raise
        _MADE[key] = made
        if len(_MADE) > MADE_KEPT:
            _MADE.popitem(last=False)
    else:
        _MADE.move_to_end(key)
    return made.with_actions([list(row) for row in made.actions])


MADE_KEPT = 64
"""Generated programs kept for reuse (the least recently asked for go first)."""
_MADE: OrderedDict[tuple[str, int, int, str], PipelineSchedule] = OrderedDict()


__all__ = ["FAMILIES", "generate"]
