"""The progress bar of ``medley train`` (rank 0): steps done, the latest loss and throughput."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from medley.runtime.records import StepRecord


class TrainProgress:
    """A rich progress bar with the latest loss and throughput."""

    def __init__(self, steps: int, start: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.description}"), TimeRemainingColumn())
        self.task = self.bar.add_task("", total=steps, completed=start)
        self.bar.start()

    def update(self, record: StepRecord) -> None:
        self.bar.update(self.task, advance=1, description=(
            f"loss {record.loss:.4f} · {record.tokens_per_s:,.0f} tok/s · "
            f"{record.step_time_s * 1e3:.0f} ms/step"))

    def close(self) -> None:
        self.bar.stop()
