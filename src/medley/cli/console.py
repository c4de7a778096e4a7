"""Where the CLI prints: consoles that print user text literally (markup never interpreted, control
characters such as ESC escaped: a cluster, tier, model or file name cannot drive the terminal),
tables that never cut a number, and progress reports on stderr.

Every table the CLI prints goes through :func:`print_table`: it is shown as built when it fits the
terminal without wrapping a cell; otherwise transposed (one column per row) when that fits; otherwise
as one block of ``field  value`` lines per row. No cell is ever shortened with an ellipsis.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from medley.spec.cluster_schema import printable

PIPED_WIDTH = 140  # rich assumes 80 columns when output is piped; scripts get wider tables


def literal(text: str) -> str:
    """``text`` with its control characters (ESC, BEL, ...) written as escapes, line breaks kept:
    what a terminal shows of a user string (:func:`printable` per line)."""
    return "\n".join(printable(line) for line in str(text).split("\n"))


class LiteralConsole(Console):
    """A rich console whose printed strings, texts and tables have their control characters
    escaped (:func:`literal`); its own styling is unaffected."""

    def print(self, *objects: object, **kwargs: object) -> None:  # type: ignore[override]
        super().print(*(_literal_renderable(o) for o in objects), **kwargs)  # type: ignore[arg-type]


def _literal_renderable(item: object) -> object:
    if isinstance(item, str):
        return literal(item)
    if isinstance(item, Text) and literal(item.plain) != item.plain:
        return Text(literal(item.plain), style=item.style)
    if isinstance(item, Table):
        return literal_table(item)
    return item


def literal_table(table: Table) -> Table:
    """A copy of ``table`` (title, caption, headers, justification and plain-string cells) with
    every string passed through :func:`literal`."""
    copy = Table(title=None if table.title is None else literal(str(table.title)),
                 caption=None if table.caption is None else literal(str(table.caption)))
    for column in table.columns:
        copy.add_column(literal(str(column.header)), justify=column.justify, no_wrap=column.no_wrap)
    for row in zip(*(list(column.cells) for column in table.columns), strict=True):
        copy.add_row(*(literal(str(cell)) for cell in row))
    return copy


def make_console(*, stderr: bool = False) -> Console:
    """A console that prints text literally (no rich markup: paths and names may contain ``[``;
    control characters escaped) and, when the output is piped and COLUMNS is unset, 140 columns wide."""
    console = LiteralConsole(stderr=stderr, markup=False, highlight=False, emoji=False)
    if console.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return console
    return LiteralConsole(stderr=stderr, markup=False, highlight=False, emoji=False, width=PIPED_WIDTH)


def styled(text: str, style: str) -> Text:
    """``text`` in ``style`` (e.g. "bold red"), never parsed as markup, control characters escaped."""
    return Text(literal(text), style=style)


def _width(console: Console, table: Table) -> int:
    return Measurement.get(console, console.options.update_width(10**6), table).maximum


def _grid(title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` (whose cells are plain strings) without cutting any cell, whatever the width;
    control characters in its strings escaped (:func:`literal_table`)."""
    table = literal_table(table)
    for column in table.columns:
        column.no_wrap = True
    if _width(console, table) <= console.width:
        console.print(table)
        return
    title = None if table.title is None else str(table.title)
    headers = [str(c.header) for c in table.columns]
    columns = [[str(cell) for cell in c.cells] for c in table.columns]
    rows = [list(r) for r in zip(*columns, strict=True)]
    label = headers[0] or "row"
    transposed = _grid(title, [label, *(r[0] for r in rows)], [
        [headers[i], *(r[i] for r in rows)] for i in range(1, len(headers))])
    if rows and _width(console, transposed) <= console.width:
        console.print(transposed)
        return
    if title:
        console.print(styled(title, "italic"), soft_wrap=False)
    pad = max(map(len, headers))
    for row in rows:
        console.print(styled(f"{label} {row[0]}", "bold"))
        for header, cell in zip(headers[1:], row[1:], strict=True):
            line = Text(f"  {header:<{pad}}  {cell}")
            line.overflow = "fold"
            console.print(line)


@contextmanager
def progress_steps(total: int, *, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A progress report on stderr: yields ``step(description)``, to call as each of ``total`` steps
    starts. A bar on a terminal; one plain line per step when stderr is a file or a pipe; nothing
    when not ``enabled`` (``--json``)."""
    if not enabled:
        yield lambda _description: None
        return
    console = make_console(stderr=True)
    if not console.is_terminal:
        done = [0]

        def line(description: str) -> None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {literal(description)}", file=sys.stderr, flush=True)

        yield line
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("starting", total=total)
        started = [False]

        def step(description: str) -> None:
            progress.update(task, description=literal(description), advance=1 if started[0] else 0)
            started[0] = True

        yield step
        progress.update(task, completed=total)
