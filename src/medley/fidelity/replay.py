"""Replay: each measured step's own compute, fed back into the simulator.

A prediction from profiles carries two errors at once: the layer times (this shared 2-core machine
varies a median +23% on identical compute between a case's fastest and median steps) and the
simulator's model of everything else (dependencies, transfers, collectives, waits, the runtime's
overhead). Replay takes the first away. With ``TrainConfig.logging.trace_actions`` the runtime records
every action's start and end on every rank (``StepRecord.action_spans_by_device``); for each
measured step, the seconds of each compute action (F, B, W, BW, emulation sleep included, and the
posting of the sends that follow it) and of each OPTIM replace the compiled durations of the same
actions (``SimProblem.duration_overrides``), and the simulated step is set against that step as
measured. Transfers, ZeRO collectives and the clipping all-reduce stay as the simulator models them
(profiled α-β link, measured per-call overheads), so the replay error is the error of that model
alone. Each rank starts at the skew it was measured at (the ranks leave the previous step's
statistics gather at different times and rank 0 then writes its record: they begin a step a few
ms apart on this machine), and the replayed step is set against the step from the first
rank's start to the last rank's end (:attr:`MeasuredStep.world_s`).

A TP group's compute actions hold its blocks' TP all-reduces (the simulator folds them into the
compute, :mod:`medley.lowering.compile`), so in replay they are measured too; its lead's durations
stand for the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from medley.schedule.ir import P2P_KINDS, Action, Kind
from medley.sim.engine import simulate
from medley.sim.problem import SimProblem

if TYPE_CHECKING:
    from medley.runtime.records import StepRecord

Spans = Sequence[Sequence]  # (action text, start s, end s) per action, in program order


def _host_durations(spans: Spans) -> list[tuple[Action, float]]:
    """Each non-transfer action of one rank's step with its measured seconds; a compute action's
    include the posting of the sends that follow it (the ``isend`` and its copy into the wire
    dtype: host time the rank cannot compute in, which the simulator's transfers, on their own
    stream, do not hold the compute stream for)."""
    out: list[tuple[Action, float]] = []
    for text, start, end in spans:
        action = Action.parse(str(text))
        seconds = float(end) - float(start)
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            if out and out[-1][0].is_compute:
                out[-1] = (out[-1][0], out[-1][1] + seconds)
        elif action.kind not in P2P_KINDS:
            out.append((action, seconds))
    return out


def replayed_kinds(action: Action) -> bool:
    """Whether replay takes ``action``'s duration from the measurement: the compute stream's."""
    return action.is_compute or action.kind is Kind.OPTIM


def step_durations(
    problem: SimProblem, spans_by_device: Mapping[int, Spans]
) -> dict[int, dict[Action, float]]:
    """The measured seconds of every compute and OPTIM action of one step, per lead device of
    ``problem``. The runtime's program of each device must list the simulator's compute and ZeRO
    actions in the same order (both read the same IR; the transfers the simulator may place itself)."""
    out: dict[int, dict[Action, float]] = {}
    for r, row in enumerate(problem.devices):
        for k, device in enumerate(row):
            if device not in spans_by_device:
                raise ValueError(f"replay: no action timings for device {device}; train with "
                                 "TrainConfig.of(trace_actions=True)")
            ran = _host_durations(spans_by_device[device])
            # The simulator may lower the transfers itself (add_send_recv's placement): compare the rest.
            expected = [a for a in problem.schedules[r].actions[k] if a.kind not in P2P_KINDS]
            if [a for a, _ in ran] != expected:
                raise ValueError(
                    f"replay: device {device} ran {len(ran)} actions besides transfers "
                    f"({' '.join(str(a) for a, _ in ran[:12])} ...) where the simulator's program has "
                    f"{len(expected)} ({' '.join(map(str, expected[:12]))} ...)")
            table: dict[Action, float] = {}
            for action, seconds in ran:
                if replayed_kinds(action):
                    if action in table:
                        raise ValueError(f"replay: device {device} runs {action} twice in one step")
                    table[action] = seconds
            out[device] = table
    return out


@dataclass(frozen=True, kw_only=True)
class MeasuredStep:
    """One step as the runtime traced it (``TrainConfig.logging.trace_actions``).

    Attributes:
        spans: by device id, (action text, start s, end s) per action in program order, times since
            the rank's step began.
        starts: by device id, when the rank's step began (one monotonic clock for the machine).
        elapsed: by device id, the rank's own step time.
    """

    spans: Mapping[int, Spans]
    starts: Mapping[int, float]
    elapsed: Mapping[int, float]

    @classmethod
    def of(cls, record: StepRecord) -> MeasuredStep:
        return cls(spans=record.action_spans_by_device, starts=record.step_start_by_device,
                   elapsed=record.step_time_by_device)

    @property
    def world_s(self) -> float:
        """From the first rank's start to the last rank's end: the step the simulator replays
        (its devices start at their measured skew)."""
        first = min(self.starts.values())
        return max(self.starts[d] + self.elapsed[d] for d in self.starts) - first

    @property
    def skew_s(self) -> dict[int, float]:
        """How long after the first rank each rank began."""
        first = min(self.starts.values())
        return {d: t - first for d, t in self.starts.items()}


def replay_step(problem: SimProblem, step: MeasuredStep) -> float:
    """The simulated step time of ``problem`` with one measured step's compute durations, each
    rank starting when it did."""
    skew = step.skew_s
    leads = {device for row in problem.devices for device in row}
    replayed = replace(problem, duration_overrides=step_durations(problem, step.spans),
                       start_s={d: skew[d] for d in leads if d in skew})
    return simulate(replayed).step_time_s


def replay_steps(problem: SimProblem, steps: Sequence[MeasuredStep]) -> list[float]:
    """:func:`replay_step` of each measured step."""
    return [replay_step(problem, step) for step in steps]
