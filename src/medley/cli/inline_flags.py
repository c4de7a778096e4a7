"""The inline plan's flags as options of every command that takes one (``medley simulate``,
``medley train``): :class:`medley.plan.inline.InlineFlags` is their one definition (names, types,
defaults, help, lowest values); this module only turns its fields into typer options.

A command asks for them with one parameter, ``inline: InlineFlags``, and :func:`inline_options`::

    @app.command("simulate")
    @inline_options()
    def simulate_cmd(cluster: ..., inline: InlineFlags = INLINE_DEFAULTS) -> None: ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from medley.plan.inline import InlineFlags

Command = TypeVar("Command", bound=Callable[..., Any])
NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(InlineFlags))
PARAMETER = "inline"  # the command's parameter that receives the flags
INLINE_DEFAULTS = InlineFlags()  # the parameter's placeholder default (the options replace it)


def inline_options(*, prefix: str = "") -> Callable[[Command], Command]:
    """The decorated command takes every inline-plan flag (each help text after ``prefix``) and
    receives them as one :class:`InlineFlags` in its ``inline`` parameter."""

    def wrap(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        if PARAMETER not in signature.parameters:
            raise TypeError(f"{command.__name__} takes no '{PARAMETER}: InlineFlags' parameter")
        kept = [p for p in signature.parameters.values() if p.name != PARAMETER]
        types = typing.get_type_hints(InlineFlags)
        added = [
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                annotation=Annotated[types[f.name], typer.Option(  # type: ignore[name-defined]
                    help=prefix + f.metadata["help"], min=f.metadata["min"])],
            )
            for f in dataclasses.fields(InlineFlags)
        ]

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            flags = InlineFlags(**{name: kwargs.pop(name) for name in NAMES})
            return command(*args, **{PARAMETER: flags}, **kwargs)

        parameters = [*kept, *added]
        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run  # type: ignore[return-value]

    return wrap
