"""A communication model with explicit α-β numbers, and small builders for simulator tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from medley.cost.interfaces import Collective
from medley.schedule.ir import PipelineSchedule
from medley.sim.problem import SimProblem, StageCost


@dataclass(kw_only=True)
class AlphaBetaComm:
    """Every transfer costs ``alpha + bytes / beta``; a ring collective over d devices moves
    (d-1)/d of the buffer per step (twice for all-reduce). ``shared_link`` names one link every
    transfer crosses (to test contention); otherwise each ordered device pair has its own link."""

    alpha: float
    beta: float
    shared_link: str | None = None
    calls: list[tuple] = field(default_factory=list)

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        self.calls.append(("p2p", src, dst, nbytes))
        return self.alpha + nbytes / self.beta

    def collective_time(self, op: Collective, devices: tuple[int, ...], nbytes: float) -> float:
        d = len(devices)
        factor = 2 if op is Collective.ALL_REDUCE else 1
        return factor * ((d - 1) * self.alpha + (d - 1) / d * nbytes / self.beta)

    def path_links(self, src: int, dst: int) -> tuple[str, ...]:
        return (self.shared_link,) if self.shared_link else (f"{src}->{dst}",)


def uniform_problem(
    schedule: PipelineSchedule, *, f: float = 1.0, b: float = 1.0, w: float = 1.0, **kwargs
) -> SimProblem:
    """One replica on devices 0..p-1, every stage with the same costs."""
    cost = StageCost(forward_s=f, backward_input_s=b, backward_weight_s=w,
                     activation_bytes=kwargs.pop("activation_bytes", 0.0),
                     send_bytes=kwargs.pop("send_bytes", 0.0))
    return SimProblem(
        schedules=[schedule], devices=[list(range(schedule.num_ranks))],
        stage_costs=[[cost] * schedule.num_stages], **kwargs,
    )
