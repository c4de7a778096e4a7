"""The progress of ``medley train`` on rank 0: a rich bar on a terminal, else one line per logged
step (every ``--log-every`` steps), so that a run under nohup or a batch system shows its
progress in its log file as it goes (a bar drawn into a file appears only at the end)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from medley.runtime.records import StepRecord


def progress_line(record: StepRecord, steps: int) -> str:
    """One logged step: ``train step 10/100 · loss 3.2104 · 12,345 tok/s · 52 ms/step`` (and the
    validation loss, the loss scale and skipped steps when the run has them)."""
    parts = [f"train step {record.step + 1}/{steps}", f"loss {record.loss:.4f}"]
    if record.eval_loss is not None:
        parts.append(f"eval loss {record.eval_loss:.4f}")
    parts += [f"{record.tokens_per_s:,.0f} tok/s", f"{record.step_time_s * 1e3:.0f} ms/step"]
    if record.loss_scale is not None:
        parts.append(f"loss scale {record.loss_scale:g}, {record.skipped_steps} skipped")
    return " · ".join(parts)


class TrainProgress:
    """A rich progress bar with the latest loss and throughput when ``stream`` (default stderr) is a
    terminal, else a :func:`progress_line` on ``stream`` at each logged step."""

    def __init__(self, steps: int, start: int, *, stream: TextIO | None = None) -> None:
        self.steps, self.stream = steps, stream or sys.stderr
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
        if self.bar is None:
            print(progress_line(record, self.steps), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
