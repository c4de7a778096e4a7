"""One way to fail on bad input: a clear message, a non-zero exit, no traceback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console

from medley.errors import MedleyInputError

__all__ = ["MedleyInputError", "exit_on_input_error"]

P = ParamSpec("P")
R = TypeVar("R")


def exit_on_input_error(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn :class:`MedleyInputError` into a red message and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except MedleyInputError as err:
            Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
            raise typer.Exit(code=2) from None

    return wrapper
