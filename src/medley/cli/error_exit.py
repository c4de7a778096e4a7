"""One way to fail: a single line on stderr and an exit status, never a traceback unless asked.

* bad input (:class:`MedleyInputError`, a usage error such as an unknown flag or a value out of
  range, or a file the OS cannot read or write): exit 2;
* Ctrl-C (KeyboardInterrupt): exit 130;
* anything else: exit 1, and the traceback only with ``--debug`` or ``MEDLEY_DEBUG=1``.

:func:`guarded` applies these rules around the whole command line (``medley.cli.main`` uses it
once, for every command); :func:`exit_on_input_error` applies the first one to a single function.
Messages are printed literally: a path with ``[/]`` or ``[red]`` in it stays as it is.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer

from medley.errors import MedleyInputError, debug_enabled
from medley.fileio import os_error_message
from medley.spec.cluster_schema import printable

__all__ = ["MedleyInputError", "exit_on_input_error", "guarded", "print_error"]

P = ParamSpec("P")
R = TypeVar("R")
INPUT_EXIT, INTERRUPT_EXIT, INTERNAL_EXIT = 2, 130, 1


def one_line(text: str) -> str:
    """``text`` with its line breaks folded into "; " (an error is one line) and any other control
    character (ESC, BEL, ...) escaped, so that a user string in it cannot drive the terminal."""
    return printable("; ".join(part.strip() for part in str(text).splitlines() if part.strip()))


def print_error(message: str) -> None:
    """``error: <message>`` on one line of stderr, as plain text (no markup is interpreted, control
    characters escaped)."""
    typer.echo(typer.style("error:", fg="red", bold=True) + " " + one_line(message), err=True)


def _os_error_line(err: OSError) -> str | None:
    if err.filename is None:
        return None
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return os_error_message(err.filename, err)
    return f"{err.filename}: {err.strerror or type(err).__name__}; check the path and its permissions."


def usage_line(err: typer.TyperException) -> str | None:
    """One line for a command-line usage error (unknown option, bad value: typer's vendored click
    ``UsageError``); None for anything else, such as the help shown for a bare ``medley``."""
    if type(err).__name__ == "NoArgsIsHelpError" or not hasattr(err, "format_message"):
        return None
    ctx = getattr(err, "ctx", None)
    command = ctx.command_path if ctx is not None else "medley"
    return f"{command}: {one_line(err.format_message())}; see '{command} --help'"


def guarded(call: Callable[[], R]) -> R:
    """Run ``call`` under the exit rules of the module docstring. typer's own exits and aborts
    pass through; a usage error becomes one line and exit 2."""
    try:
        return call()
    except (typer.Exit, typer.Abort):
        raise
    except typer.TyperException as err:
        line = usage_line(err)
        if line is None:
            raise
        print_error(line)
        raise typer.Exit(code=INPUT_EXIT) from None
    except MedleyInputError as err:
        print_error(str(err))
        raise typer.Exit(code=INPUT_EXIT) from None
    except KeyboardInterrupt:
        print_error("interrupted (Ctrl-C)")
        raise typer.Exit(code=INTERRUPT_EXIT) from None
    except OSError as err:
        line = _os_error_line(err)
        if line is None or err.errno == errno.EPIPE or debug_enabled():
            raise
        print_error(line)
        raise typer.Exit(code=INPUT_EXIT) from None
    except Exception as err:
        if debug_enabled():
            raise
        print_error(f"{type(err).__name__}: {one_line(str(err))}; rerun with --debug for the traceback")
        raise typer.Exit(code=INTERNAL_EXIT) from None


def exit_on_input_error(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn :class:`MedleyInputError` raised by ``fn`` into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except MedleyInputError as err:
            print_error(str(err))
            raise typer.Exit(code=INPUT_EXIT) from None

    return wrapper
