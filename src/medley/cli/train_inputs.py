"""What ``medley train`` checks before it imports torch or starts a rank: that the inputs it
was given exist (a mistyped ``--data`` is one line in well under a second), and whether the
checkpoint directory already holds the run's last step (then there is nothing to do)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import typer

from medley.errors import MedleyInputError
from medley.fileio import read_user_json
from medley.runtime.checkpoint_layout import META_FILE, step_directories

T = TypeVar("T")
_SYNTHETIC = "synthetic"


def home(value: T) -> T:
    """A path flag's callback: a leading ``~`` (or ``~user``) is that home, as a shell expands it
    before a word but not after ``--flag=`` (nor in a job file, whose values pass here too)."""
    if not isinstance(value, (str, Path)) or not str(value).startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise typer.BadParameter(f"{value}: {str(value).split('/')[0]} names no user's home here; write "
                                 "the path out")
    return type(value)(expanded)


def check_inputs_exist(given: dict[str, str | Path | None]) -> None:
    """Every input path given (flag -> value: ``--data``, ``--tokenizer``, ...) exists."""
    for flag, value in given.items():
        if value is None or (flag in ("--data", "--val-data") and value == _SYNTHETIC):
            continue
        if not os.path.lexists(value):
            raise MedleyInputError(f"{flag} {value}: no such file or directory; check the path")


def finished_line(checkpoint_dir: Path | None, steps: int) -> str | None:
    """A line saying there is nothing to train when the newest checkpoint in ``checkpoint_dir``
    already holds step ``steps`` (its ``medley.json`` says so); None otherwise, and whenever the
    directory needs the full check that resuming does."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return None
    found = [p for p in step_directories(checkpoint_dir) if not p.is_symlink()]
    if not found:
        return None
    try:
        meta = read_user_json(found[-1] / META_FILE, what="checkpoint metadata", fix="resume checks it")
    except MedleyInputError:
        return None
    done = meta.get("next_step") if isinstance(meta, dict) else None
    if not isinstance(done, int) or isinstance(done, bool) or done < steps:
        return None
    return (f"--checkpoint-dir {checkpoint_dir}: {found[-1].name} already holds step {done} of --steps "
            f"{steps}: nothing to train (raise --steps to go on, or medley export {found[-1]})")
