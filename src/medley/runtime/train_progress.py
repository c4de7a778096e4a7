"""The progress of ``medley train`` on rank 0: a rich bar on a terminal, else one line per logged
step (every ``--log-every`` steps), so that a run under nohup or a batch system shows its
progress in its log file as it goes (a bar drawn into a file appears only at the end), with
the learning rate, memory and the time left (measured over the logged steps so far: checkpoints
and evaluations included)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from medley.runtime.records import StepRecord


def progress_line(record: StepRecord, steps: int, *, eta_s: float | None = None) -> str:
    """One logged step: ``train step 10/100 · loss 3.2104 · lr 3.0e-04 · 12,345 tok/s (4,321
    learned) · 52 ms/step · 11.2 GB · ETA 4m10s`` (the learned tokens where the loss skips some, the
    most memory any device peaked at where measured, the validation loss, the loss scale and
    skipped steps when the run has them)."""
    parts = [f"train step {record.step + 1}/{steps}", f"loss {record.loss:.4f}"]
    if record.eval_loss is not None:
        parts.append(f"eval loss {record.eval_loss:.4f}")
    parts.append(f"lr {record.lr:.2e}")
    rate = f"{record.tokens_per_s:,.0f} tok/s"
    if record.learned_tokens_per_s and record.learned_tokens_per_s < 0.999 * record.tokens_per_s:
        rate += f" ({record.learned_tokens_per_s:,.0f} learned)"
    parts += [rate, f"{record.step_time_s * 1e3:.0f} ms/step"]
    if record.peak_memory_bytes:
        parts.append(f"{max(record.peak_memory_bytes.values()) / 1e9:.1f} GB")
    if record.loss_scale is not None:
        parts.append(f"loss scale {record.loss_scale:g}, {record.skipped_steps} skipped")
    if eta_s is not None:
        minutes, seconds = divmod(round(eta_s), 60)
        hours, minutes = divmod(minutes, 60)
        parts.append(f"ETA {hours}h{minutes:02d}m" if hours else f"ETA {minutes}m{seconds:02d}s")
    return " · ".join(parts)


class TrainProgress:
    """A rich progress bar with the latest loss and throughput when ``stream`` (default stderr) is a
    terminal, else a :func:`progress_line` on ``stream`` at each logged step."""

    def __init__(self, steps: int, start: int, *, stream: TextIO | None = None) -> None:
        self.steps, self.stream = steps, stream or sys.stderr
        self.started: tuple[float, int] | None = None  # (time, step) of the first logged step
        self.bar = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), TimeRemainingColumn(),
                                console=Console(file=self.stream))
            self.task = self.bar.add_task("", total=steps, completed=start)
            self.bar.start()

    def update(self, record: StepRecord) -> None:
        """One more step done (its record made at the logged step that followed it)."""
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=(
                f"loss {record.loss:.4f} · {record.tokens_per_s:,.0f} tok/s · "
                f"{record.step_time_s * 1e3:.0f} ms/step"))

    def logged(self, record: StepRecord) -> None:
        """The statistics were gathered up to ``record``'s step: a line when there is no bar."""
        if self.bar is not None:
            return
        now, eta = time.monotonic(), None
        if self.started is None:  # the first step includes start-up: the rate is measured after it
            self.started = (now, record.step)
        elif record.step > self.started[1]:
            per_step = (now - self.started[0]) / (record.step - self.started[1])
            eta = per_step * (self.steps - record.step - 1)
        print(progress_line(record, self.steps, eta_s=eta), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
