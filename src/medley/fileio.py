"""Reading user files with errors that name the file, and writing files atomically.

The writers here never follow a symbolic link at the path they write or remove, so a link planted
in a directory medley writes (a received checkpoint directory, an output folder) cannot make it
change a file elsewhere: :func:`write_atomically` (a new temporary file renamed over the path: a
link there is replaced, not written through) for plans, traces, charts, profiles and reports;
:func:`open_no_follow`, :func:`write_new_file` and :func:`append_text` for the lock file,
``medley.json``, exports and logs; :func:`remove_path` for every tree medley removes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any, BinaryIO

from medley.errors import MedleyInputError


def read_toml(path: Path, *, what: str) -> dict[str, Any]:
    """Parsed TOML of ``path``; a missing, binary, malformed or not regular (FIFO, device) file is
    a :class:`MedleyInputError` naming the file (``what`` says which kind of file was expected,
    e.g. "cluster")."""
    text = read_user_text(path, what=f"{what} file", fix=f"give a {what} TOML file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise MedleyInputError(f"{path}: malformed TOML ({err}); fix the syntax there.") from None
    except RecursionError:
        raise MedleyInputError(f"{path}: TOML nested too deeply; fix the file.") from None


def anchored(value: str, base: Path, *, is_path: bool) -> str:
    """A relative ``value`` taken from ``base`` (absolute) when it is a path (``is_path``) or names
    something that exists there; else ``value`` as it is (text that only looks like a path)."""
    if not value or Path(value).is_absolute():
        return value
    there = base / value
    return str(there) if is_path or there.exists() else value


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


class UnsafePathError(OSError):
    """A path medley was to write is a symbolic link, a hard link to another name or not a
    regular file: refused, so that nothing outside the paths given is changed. ``filename`` is
    the path, ``strerror`` what it is."""


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW)`` for writing: a symbolic link at ``path`` (even a
    dangling one), a FIFO, a device, a directory or a regular file with another hard link is an
    :class:`UnsafePathError` (with ``O_CREAT | O_EXCL`` any existing entry is an ``EEXIST``
    OSError). ``O_TRUNC`` is applied only once the file is known to be safe. Returns the
    descriptor; the caller closes it."""
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(errno.ELOOP, "is a symbolic link, which medley never writes through",
                                  str(path)) from None
        if err.errno == errno.ENXIO:  # a FIFO without a reader
            raise UnsafePathError(errno.ENXIO, "is not a regular file, so medley does not write it",
                                  str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        what = None
        if not stat.S_ISREG(info.st_mode):
            what = "is not a regular file, so medley does not write it"
        elif info.st_nlink > 1:
            what = "has other hard links, so writing it would change another file too"
        if what is not None:
            raise UnsafePathError(errno.EPERM, what, str(path))
        os.set_blocking(fd, True)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new_file(path: Path, data: bytes | str) -> None:
    """Create ``path`` (it must not exist, not even as a link) and write ``data`` into it, synced.
    An OSError (``EEXIST``, disk full) propagates; a partly written file is removed."""
    raw = data.encode() if isinstance(data, str) else data
    fd = open_no_follow(Path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (created if missing), never through a link
    (:func:`open_no_follow`); an OSError propagates."""
    with os.fdopen(open_no_follow(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as handle:
        handle.write(text)


def remove_path(path: Path) -> None:
    """Remove ``path`` if it is there: a directory tree, a file, or a symbolic link itself (never
    what a link points to; links inside a tree are removed as links). Best effort, as cleanup
    after a failure: what cannot be removed stays, and nothing is raised."""
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def os_error_message(path: Path, err: OSError) -> str:
    """One line for a failed write: the path, the reason and, when the disk is full, its free space."""
    if isinstance(err, UnsafePathError):
        return f"{err.filename}: {err.strerror}; remove it or choose another location."
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
    whole or not at all, and an old version stays intact until then. The temporary file is new
    (``O_EXCL``, not following links) and the rename replaces a link at ``path`` rather than
    writing through it. A failed write (disk full,
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


# Reading user files. Every file a user names (cluster, plan, model and catalog TOML, config.json,
# tokenizer.json, safetensors, data sets, profiles) is read through these, so that a FIFO, a
# socket, a device or a directory where a file belongs is refused at once instead of blocking
# forever (a FIFO without a writer) or reading without end (/dev/zero).

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"))


def _not_regular(path: Path, mode: int, what: str) -> MedleyInputError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return MedleyInputError(f"{path}: is {kind}, not a regular file; give the {what} itself.")


def check_regular_file(path: Path, *, what: str) -> None:
    """Refuse ``path`` if it exists but is not a regular file (after symbolic links), for readers
    that open the path themselves (safetensors, pyarrow, numpy's memmap); a missing path is left
    to the caller's own message. ``what`` names the file expected ("model weights file")."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(Path(path), mode, what)


def open_user_file(path: Path, *, what: str, flag: str | None = None) -> BinaryIO:
    """``path`` opened for reading (binary), once it is known to be a regular file: it is opened
    non-blocking, so a FIFO without a writer cannot stall, and checked on the open descriptor, so
    nothing swapped in between is read. A missing or unreadable file is a
    :class:`MedleyInputError` naming it (and ``flag``, the option that gave it, as what to
    check); the caller closes the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise MedleyInputError(_unreadable(path, err, what, flag)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(Path(path), mode, what)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unreadable(path: Path, err: OSError, what: str, flag: str | None) -> str:
    return f"{path}: cannot read the {what} ({err.strerror or err}); check {flag or 'the path'}."


def read_user_bytes(path: Path, *, what: str, flag: str | None = None) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_user_file`)."""
    with open_user_file(path, what=what, flag=flag) as handle:
        try:
            return handle.read()
        except OSError as err:
            raise MedleyInputError(_unreadable(path, err, what, flag)) from None


def read_user_text(path: Path, *, what: str, fix: str | None = None, flag: str | None = None) -> str:
    """The UTF-8 text of the regular file ``path``; other bytes are a :class:`MedleyInputError`
    naming the byte offset and ``fix`` (default: give a UTF-8 text file)."""
    raw = read_user_bytes(path, what=what, flag=flag)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        fix = fix or f"give a UTF-8 {what}"
        raise MedleyInputError(f"{path}: not UTF-8 text (byte {err.start}); {fix}.") from None


def read_user_json(path: Path, *, what: str, fix: str) -> Any:
    """The parsed JSON of the regular UTF-8 file ``path``; malformed or too deeply nested JSON is
    a :class:`MedleyInputError` naming the file, where, and ``fix``. NaN and Infinity literals
    are read as Python's json reads them: check values where they matter."""
    text = read_user_text(path, what=what, fix=fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise MedleyInputError(f"{path}: malformed JSON ({err.msg} at line {err.lineno}, column "
                               f"{err.colno}); {fix}.") from None
    except RecursionError:
        raise MedleyInputError(f"{path}: JSON nested too deeply; {fix}.") from None
