"""A setting's flag, defined on the dataclass field that holds it: :func:`setting` puts a
:class:`Flag` in the field's metadata, and ``medley.cli.options`` makes the command-line options
(and so the job-file keys and docs/job-file.md) from the fields. One definition per setting: its
name, type, default and bounds are the field's; nothing here imports torch or typer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

METADATA_KEY = "medley.flag"


@dataclass(frozen=True, kw_only=True)
class Flag:
    """How a dataclass field is given as a flag (``--name``) and a job-file key (``name``).

    Attributes:
        help: the flag's help text (also docs/job-file.md's).
        name: the flag's name with underscores when it is not the field's (``checkpoint_dir`` for
            ``CheckpointConfig.dir``); the flag is ``--`` and the name with dashes.
        minimum: the lowest value the flag takes (refused below it), or None.
        maximum: the highest, or None.
        path: the value is a path: a leading ``~`` is expanded, ``medley launch`` makes it absolute
            and a job file's relative value is relative to the file.
        off: the flag's 0 means the field's None (``--clip-norm 0``: no clipping).
        parse: the flag takes text, and this makes the field's value of it (``--slowdown 0=2``).
        section: the job-file section when it is not the dataclass's own.
    """

    help: str
    name: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    path: bool = False
    off: bool = False
    parse: Callable[[str], Any] | None = None
    section: str | None = None


def setting(default: object = dataclasses.MISSING, help: str = "", *,  # noqa: A002 - the flag's help
            factory: Callable[[], object] | None = None, **flag: Any) -> Any:
    """A dataclass field that is a flag: its default (or ``factory``), its help and the rest of
    :class:`Flag`."""
    metadata = {METADATA_KEY: Flag(help=help, **flag)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The field's :class:`Flag`, or None when it is no flag."""
    return field.metadata.get(METADATA_KEY)


def flag_name(field: dataclasses.Field) -> str:
    """The name of the field's flag (and job-file key), underscores for dashes."""
    flag = flag_of(field)
    return flag.name if flag is not None and flag.name else field.name
