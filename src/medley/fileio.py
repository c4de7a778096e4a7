"""Reading user files with errors that name the file, and writing files atomically."""

from __future__ import annotations

import os
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


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: the file appears
    whole or not at all, and an old version stays intact until then."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
