"""Reading user files with errors that name the file, and writing files atomically."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from medley.errors import MedleyInputError


def read_toml(path: Path, *, what: str) -> dict[str, Any]:
    """Parsed TOML of ``path``; a missing, binary or malformed file is a :class:`MedleyInputError`
    naming the file (``what`` says which kind of file was expected, e.g. "cluster")."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise MedleyInputError(
            f"{path}: cannot read the {what} file ({err.strerror}); check the path."
        ) from None
    except UnicodeDecodeError:
        raise MedleyInputError(f"{path}: not a UTF-8 text file; give a {what} TOML file.") from None
    except tomllib.TOMLDecodeError as err:
        raise MedleyInputError(f"{path}: malformed TOML ({err}); fix the syntax there.") from None


def _existing_ancestor(path: Path) -> Path:
    for parent in path.absolute().parents:
        if parent.exists():
            return parent
    return Path("/")


def check_output_file(path: Path, *, flag: str) -> Path:
    """``path`` can be written as a file: not a directory, no file in the way of its folder, and
    the nearest existing folder writable. Otherwise a :class:`MedleyInputError` naming ``flag``,
    the path and the fix. Call it before any work so nothing is computed for a file that cannot
    be written."""
    path = Path(path)
    if path.is_dir():
        raise MedleyInputError(
            f"{flag} {path}: is a directory; give the path of a file (inside it or elsewhere).")
    _check_parent(path, flag=flag)
    return path


def check_output_dir(path: Path, *, flag: str) -> Path:
    """``path`` can be used (or created) as a directory: not a file, no file in the way, writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise MedleyInputError(f"{flag} {path}: is a file, not a directory; give a directory path.")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise MedleyInputError(f"{flag} {path}: the directory is not writable; choose another one.")
        return path
    _check_parent(path, flag=flag)
    return path


def _check_parent(path: Path, *, flag: str) -> None:
    ancestor = _existing_ancestor(path)
    if not ancestor.is_dir():
        raise MedleyInputError(
            f"{flag} {path}: {ancestor} is a file, not a directory; choose a path under a directory.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise MedleyInputError(f"{flag} {path}: cannot write in {ancestor} (permission denied); "
                               "choose another location.")


def os_error_message(path: Path, err: OSError) -> str:
    """One line for a failed write: the path, the reason and, when the disk is full, its free space."""
    reason = err.strerror or str(err) or type(err).__name__
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(_existing_ancestor(Path(path)) if not Path(path).exists() else path).free
            reason += f", {free / 2**20:.1f} MiB free"
        except OSError:
            pass
        return f"{path}: cannot write ({reason}); free some space or choose another location."
    return f"{path}: cannot write ({reason}); check the path and its permissions."


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: the file appears
    whole or not at all, and an old version stays intact until then. A failed write (disk full,
    permissions) is a :class:`MedleyInputError` naming the path; no temporary file is left."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise MedleyInputError(os_error_message(path, err)) from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
