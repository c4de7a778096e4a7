"""Discrete-event simulation of one training step: step time, bubbles, exposed communication and
memory per device, and the timeline behind them (:mod:`medley.sim.trace`, :mod:`medley.sim.gantt`)."""

from medley.sim.engine import SimulationError, simulate
from medley.sim.problem import CollectiveCost, CollectiveTable, SimProblem, StageCost
from medley.sim.result import DeviceReport, SimResult, StageZeroReport

__all__ = [
    "CollectiveCost",
    "CollectiveTable",
    "DeviceReport",
    "SimProblem",
    "SimResult",
    "SimulationError",
    "StageCost",
    "StageZeroReport",
    "simulate",
]
