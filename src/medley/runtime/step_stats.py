"""A rank's per-step statistics, kept where they are made until the ranks gather them.

The training loop does not wait on the host during a step (as torchtitan's loop, which reads its
losses every ``log_freq`` steps): each step leaves a :class:`PendingStep`, whose loss sum,
gradient-norm share and validation loss stay tensors on the device and whose host figures
(times, emulation sleeps, allocator peaks, the loss scale) are plain floats. Every
``--log-every`` steps, and at the first and last steps and each checkpoint,
:meth:`StatsInterval.gather` gathers the pending steps of every rank in one all-gather and copies
them to the host once: the one host sync of the interval. On CUDA a step's wall time comes from
two CUDA events on the compute stream (:class:`StepTimer`), read at that point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from medley.runtime.torch_adapter import all_gather_single

#: The columns of a gathered row: first those made on the device, then the host's, then the
#: seconds in each of the executor's ACTION_CATEGORIES (in that order).
DEVICE_COLUMNS = ("loss", "grad_sq_norm", "eval_loss")
HOST_COLUMNS = ("seconds", "slept", "peak_bytes", "loss_scale", "skipped_steps", "skipped_now")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) on ``device``: on CUDA through pinned memory without waiting (a
    plain copy from pageable memory waits for the stream: a host sync per step)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class StepTimer:
    """A step's wall time: ``time.perf_counter`` on CPU; on CUDA two events on the current stream,
    so that nothing waits for the step to end (:meth:`seconds` waits, at log time)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.started = self.ended = 0.0
        self.events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def start(self) -> None:
        self.started = time.perf_counter()
        if self.events is not None:
            self.events[0].record()

    def stop(self) -> None:
        self.ended = time.perf_counter()
        if self.events is not None:
            self.events[1].record()

    def seconds(self) -> float:
        """The step's seconds; on CUDA this waits for the step's end event."""
        if self.events is None:
            return self.ended - self.started
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


@dataclass(kw_only=True)
class PendingStep:
    """One step's statistics on this rank, until its interval is gathered.

    Attributes:
        step: the step index.
        lr: the learning rate the step used.
        device_values: :data:`DEVICE_COLUMNS` (fp64, on the rank's device): this rank's share of
            the loss sum, of the squared gradient norm and of the validation loss sum (0 when no
            evaluation was due).
        timer: the step's wall time.
        host_values: :data:`HOST_COLUMNS` after ``seconds``, then the seconds per action category.
        spans: with ``trace_actions``, (program start, [(action, start, end)]) of the step.
        learned_tokens: the targets the global batch's loss counts (known on the host).
    """

    step: int
    lr: float
    device_values: torch.Tensor
    timer: StepTimer
    host_values: list[float]
    spans: tuple[float, list[tuple[str, float, float]]] | None = None
    learned_tokens: int = 0


@dataclass(kw_only=True)
class GatheredStep:
    """One step as every rank saw it (rank 0's view after :meth:`StatsInterval.gather`).

    Attributes:
        pending: this rank's :class:`PendingStep` of the step.
        rows: per global rank, the step's row (:data:`DEVICE_COLUMNS`, :data:`HOST_COLUMNS`, then
            the seconds per action category), as floats.
        spans: with ``trace_actions``, every rank's ``PendingStep.spans`` by global rank; else empty.
    """

    pending: PendingStep
    rows: list[list[float]]
    spans: list[tuple[float, list[tuple[str, float, float]]]] = field(default_factory=list)

    def column(self, name: str) -> list[float]:
        """One named column, by global rank."""
        index = (DEVICE_COLUMNS + HOST_COLUMNS).index(name)
        return [row[index] for row in self.rows]

    def actions(self, categories: tuple[str, ...]) -> list[dict[str, float]]:
        """Seconds per action category, by global rank."""
        start = len(DEVICE_COLUMNS) + len(HOST_COLUMNS)
        return [dict(zip(categories, row[start:], strict=True)) for row in self.rows]


class StatsInterval:
    """The steps since the last gather, on one rank."""

    def __init__(self, *, world: int, device: torch.device, trace_actions: bool) -> None:
        self.world, self.device, self.trace_actions = world, device, trace_actions
        self.pending: list[PendingStep] = []

    def add(self, step: PendingStep) -> None:
        self.pending.append(step)

    def __len__(self) -> int:
        return len(self.pending)

    def gather(self) -> list[GatheredStep]:
        """Collective: every rank's rows of the pending steps, by one all-gather of
        ``[steps, columns]`` fp64 and one copy to the host (``tolist``); the interval then starts
        afresh. With ``trace_actions`` also one ``all_gather_object`` of the steps' spans."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        on_device = torch.stack([p.device_values for p in pending])
        host = torch.tensor([[p.timer.seconds(), *p.host_values] for p in pending], dtype=torch.float64)
        if self.device.type == "cuda":
            host = host.pin_memory().to(self.device, non_blocking=True)
        local = torch.cat([on_device, host], dim=1).contiguous()
        gathered = torch.empty(self.world * local.numel(), dtype=torch.float64, device=self.device)
        all_gather_single(gathered, local.reshape(-1))
        rows = gathered.view(self.world, len(pending), -1).tolist()  # the interval's one host sync
        spans: list[list] = [[] for _ in pending]
        if self.trace_actions:
            every: list = [None] * self.world
            dist.all_gather_object(every, [p.spans for p in pending])
            spans = [[every[r][i] for r in range(self.world)] for i in range(len(pending))]
        return [GatheredStep(pending=p, rows=[rows[r][i] for r in range(self.world)], spans=spans[i])
                for i, p in enumerate(pending)]
