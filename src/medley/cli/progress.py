"""The planner's progress bar: ``medley plan`` draws what :func:`medley.search.planner.search`
reports through its ``progress`` callback (the planner itself prints nothing)."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class PhaseBar:
    """A transient rich bar on stderr, one task per phase the search reports; a no-op when not
    ``enabled`` or when stderr is no terminal (rich then leaves an empty line behind, which came
    before the one line of an error). Use it as a context manager and pass it as the search's
    ``progress``."""

    def __init__(self, enabled: bool) -> None:
        self._console = Console(stderr=True)
        self.enabled = enabled and self._console.is_terminal
        self._bar: Progress | None = None
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> PhaseBar:
        if self.enabled:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
            )
            self._bar.__enter__()
        return self

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self._bar is None:
            return
        if phase not in self._tasks:
            self._tasks[phase] = self._bar.add_task(phase, total=total)
        self._bar.update(self._tasks[phase], completed=done, total=total)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, error, trace)
            self._bar = None
