"""Command-line options made from the dataclass fields that define the settings
(:func:`medley.flags.setting`): the inline plan's flags (:class:`medley.plan.inline.InlineFlags`,
taken by ``simulate`` and ``train``) and the run's settings (the sections of
:class:`medley.runtime.settings.TrainConfig`, taken by ``train``). A setting's name, type,
default, help and bounds are written once, on its field; this module only turns fields into typer
options and the parsed values back into the dataclass.

A command asks for them with one keyword-only parameter and a decorator::

    @app.command("simulate")
    @inline_options()
    def simulate_cmd(cluster: ..., *, inline: InlineFlags) -> None: ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from medley.cli.train_inputs import home
from medley.flags import flag_name, flag_of
from medley.plan.inline import InlineFlags
from medley.runtime.settings import TrainConfig

Command = TypeVar("Command", bound=Callable[..., Any])


def _fields(kind: type) -> list[tuple[dataclasses.Field, Any]]:
    """The fields of ``kind`` that are flags, each with its resolved type."""
    types = typing.get_type_hints(kind)
    return [(f, types[f.name]) for f in dataclasses.fields(kind) if flag_of(f) is not None]


SECTIONS: dict[str, type] = typing.get_type_hints(TrainConfig)  # section name -> its dataclass
INLINE_NAMES: tuple[str, ...] = tuple(flag_name(f) for f, _ in _fields(InlineFlags))
# Flag name -> its job-file section, for every setting of TrainConfig (``[plan]`` for the emulation's).
SETTING_SECTIONS: dict[str, str] = {
    flag_name(f): flag_of(f).section or section  # type: ignore[union-attr]
    for section, kind in SECTIONS.items() for f, _ in _fields(kind)
}


def _option(field: dataclasses.Field, kind: Any, *, prefix: str) -> inspect.Parameter:
    """The typer parameter of one field: a flag's 0 for an ``off`` field's None, text for a
    ``parse`` field, ``~`` expanded for a path."""
    flag = flag_of(field)
    assert flag is not None
    default = field.default
    if flag.parse is not None:
        kind, default = str | None, None
    elif flag.off:
        kind = next(t for t in typing.get_args(kind) if t is not type(None))
    info = typer.Option(help=prefix + flag.help, min=flag.minimum, max=flag.maximum,
                        callback=home if flag.path else None)
    return inspect.Parameter(flag_name(field), inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, info])


def _value(field: dataclasses.Field, given: Any) -> Any:
    """The field's value of the flag's: None for an ``off`` field's 0, ``parse`` of a text."""
    flag = flag_of(field)
    assert flag is not None
    if flag.parse is not None:
        return flag.parse(given)
    return None if flag.off and not given else given


def _with(parameter: str, added: list[inspect.Parameter],
          build: Callable[[dict[str, Any]], Any]) -> Callable[[Command], Command]:
    """The decorated command takes the ``added`` options in place of its ``parameter``, which
    receives ``build`` of their values."""

    def wrap(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        if parameter not in signature.parameters:
            raise TypeError(f"{command.__name__} takes no '{parameter}' parameter")
        kept = [p for p in signature.parameters.values() if p.name != parameter]
        clash = {p.name for p in kept} & {p.name for p in added}
        if clash:
            raise TypeError(f"{command.__name__}: {sorted(clash)} are options of its '{parameter}' too")
        names = [p.name for p in added]

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            return command(*args, **{parameter: build(values)}, **kwargs)

        parameters = [*kept, *added]
        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run  # type: ignore[return-value]

    return wrap


def inline_options(*, prefix: str = "") -> Callable[[Command], Command]:
    """The decorated command takes every inline-plan flag (each help text after ``prefix``) and
    receives them as one :class:`InlineFlags` in its ``inline`` parameter."""
    fields = _fields(InlineFlags)
    added = [_option(f, kind, prefix=prefix) for f, kind in fields]
    return _with("inline", added, lambda values: InlineFlags(**values))


def adapter_options() -> Callable[[Command], Command]:
    """The decorated command takes the inline plan's LoRA flags (``--lora-rank``, ...: the
    ``lora_*`` fields of :class:`InlineFlags`, for a command that plans without the other inline
    flags) and receives their values as one dict in its ``adapter_flags`` parameter."""
    added = [_option(f, kind, prefix="") for f, kind in _fields(InlineFlags) if f.name.startswith("lora_")]
    return _with("adapter_flags", added, dict)


def settings_options() -> Callable[[Command], Command]:
    """The decorated command takes every flag of :class:`TrainConfig`'s sections and receives them
    as one :class:`TrainConfig` in its ``config`` parameter (the settings that are no flag at
    their defaults)."""
    per_section = {section: _fields(kind) for section, kind in SECTIONS.items()}
    added = [_option(f, kind, prefix="") for fields in per_section.values() for f, kind in fields]

    def build(values: dict[str, Any]) -> TrainConfig:
        return TrainConfig(**{
            section: SECTIONS[section](**{f.name: _value(f, values[flag_name(f)]) for f, _ in fields})
            for section, fields in per_section.items()
        })

    return _with("config", added, build)
