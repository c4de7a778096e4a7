"""Where checkpoints lie in ``--checkpoint-dir``, without torch: the one definition of the names
that the run, the CLI (before it imports torch), the elastic agents and the tests read.

A complete save is ``step-NNNNNNNN`` (the step the run goes on from, eight digits) holding the DCP
files and the manifest ``medley.json``; a save under way is ``.tmp-step-NNNNNNNN`` and appears under
its name only by a rename, once complete (:mod:`medley.runtime.checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

from medley.errors import MedleyInputError

PREFIX = "step-"  # a step directory's name: PREFIX + the next step, 8 digits
META_FILE = "medley.json"  # the manifest in each step directory (medley.runtime.checkpoint_verify)
TEMP_PREFIX = ".tmp-"  # a save under way: TEMP_PREFIX + its step directory's name
KEEP = 2  # default of ``--keep``: newest checkpoints kept; older ones are deleted after each save


def checkpoint_path(directory: Path, next_step: int) -> Path:
    """The step directory of a save the run goes on from at ``next_step``."""
    return Path(directory) / f"{PREFIX}{next_step:08d}"


def step_of(path: Path) -> int:
    """The next step a step directory's name gives (``step-00000006`` -> 6)."""
    return int(Path(path).name.removeprefix(PREFIX))


def step_directories(directory: Path) -> list[Path]:
    """The entries named like step directories under ``directory``, in step order (links and
    unfinished ones included: :func:`latest_checkpoint` checks them)."""
    return sorted(Path(directory).glob(f"{PREFIX}*"), key=lambda p: p.name)


def latest_checkpoint(directory: Path | None) -> Path | None:
    """The checkpoint with the highest step under ``directory`` (None if there is none). A step
    directory with files but no ``medley.json`` is an error: checkpoints only appear (by rename)
    once complete, so it was damaged, and resuming from an older one would overwrite it. A
    ``step-N`` that is a symbolic link is refused: it would make medley read and rotate a
    directory outside the one given."""
    if directory is None or not Path(directory).is_dir():
        return None
    found = step_directories(directory)
    link = next((p for p in found if p.is_symlink()), None)
    if link is not None:
        raise MedleyInputError(
            f"checkpoint {link}: is a symbolic link; medley reads and writes checkpoints only inside "
            "--checkpoint-dir: replace it by the step directory itself, or delete the link")
    steps = [p for p in found if p.is_dir()]
    for path in steps:
        if not (path / META_FILE).is_file() and any(path.iterdir()):
            raise MedleyInputError(
                f"checkpoint {path}: {META_FILE} is missing; restore it, or delete {path} to resume from "
                "the checkpoint before it")
    done = [p for p in steps if (p / META_FILE).is_file()]
    return done[-1] if done else None
