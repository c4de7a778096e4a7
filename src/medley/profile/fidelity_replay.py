"""Replay: each measured step's own compute, fed back into the simulator.

A prediction from profiles carries two errors at once: the layer times (this shared 2-core machine
varies a median +23% on identical compute between a case's fastest and median steps) and the
simulator's model of everything else (dependencies, transfers, collectives, waits, the runtime's
overhead). Replay takes the first away. With ``TrainConfig.trace_actions`` the runtime records
every action's start and end on every rank (``StepRecord.action_spans_by_device``); for each
measured step, the seconds of each compute action (F, B, W, BW, emulation sleep included, and the
posting of the sends that follow it) and of each OPTIM replace the compiled durations of the same
actions (``SimProblem.duration_overrides``), and the simulated step is set against that step as
measured. Transfers, ZeRO collectives and the clipping all-reduce stay as the simulator models them
(profiled α-β link, measured per-call overheads), so the replay error is the error of that model alone.

A TP group's compute actions hold its blocks' TP all-reduces (the simulator folds them into the
compute, :mod:`medley.plan.compile`), so in replay they are measured too; its lead's durations
stand for the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from medley.schedule.ir import P2P_KINDS, Action, Kind
from medley.sim.engine import simulate
from medley.sim.problem import SimProblem

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
                                 "TrainConfig(trace_actions=True)")
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


def replay_step(problem: SimProblem, spans_by_device: Mapping[int, Spans]) -> float:
    """The simulated step time of ``problem`` with one measured step's compute durations."""
    measured = step_durations(problem, spans_by_device)
    return simulate(replace(problem, duration_overrides=measured)).step_time_s


def replay_steps(problem: SimProblem, steps: Sequence[Mapping[int, Spans]]) -> list[float]:
    """:func:`replay_step` of each measured step."""
    return [replay_step(problem, spans) for spans in steps]
