"""What one run of the event loop leaves behind: the record :mod:`medley.sim.report` reads.

The engine (:mod:`medley.sim.engine`) fills a :class:`RunRecord` and hands it to the report; the
report never sees the engine's working state, and neither module imports the other's names.
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.schedule.ir import Action
from medley.sim.program import Program


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """The finished timeline of one simulated step, indexed by dense device index.

    Attributes:
        prog: the flattened program that ran; ``prog.times`` holds every event's final time
            (end of each F/B/BW, arrival of each transfer, end of each collective).
        busy: per device, summed duration of its compute actions (F, B, W, BW, OPTIM).
        compute: per device, (start, end, action) of each compute action in run order.
        mem_events: per device, (time, bytes) memory changes (negative: freed).
        exposed_transfer: per device, summed wait of its compute actions for incoming transfers
            past the end of the action that produced them.
        collective_waits: per device, (data ready, start, collective instance) of each compute
            action that waited past the arrival of its data for the collective it depends on.
        xfer_start: per transfer id, when it started on its links.
        coll_start: per collective instance, when it started.
        executed_ops: ops the engine executed over all devices: compute actions, sends (the
            lowered SENDs and those implied after a compute action), collective issues and local
            ZeRO actions. RECVs are not ops (receives are posted early).
    """

    prog: Program
    busy: list[float]
    compute: list[list[tuple[float, float, Action]]]
    mem_events: list[list[tuple[float, float]]]
    exposed_transfer: list[float]
    collective_waits: list[list[tuple[float, float, int]]]
    xfer_start: list[float]
    coll_start: list[float]
    executed_ops: int
