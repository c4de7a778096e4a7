"""One run per checkpoint directory: a lock file that names its holder.

Rank 0 of a run holds an exclusive ``flock`` on ``<checkpoint dir>/.medley.lock`` for the whole
run and writes its host, pid and a random token into it (every other rank then reads the token
back to prove it sees the same directory: :func:`medley.runtime.checkpoint.check_shared`). The
kernel drops the lock when the holder exits, however it ends (``kill -9`` included), so a lock
left by a dead run is simply taken over; while the holder lives, a second run is refused with a
message that names it. On a file system without ``flock`` the pid written in the file decides (a
holder on this host is alive while its pid is). The lock file is opened without following links
(:func:`medley.fileio.open_no_follow`): a ``.medley.lock`` that is a symbolic link, a hard link or
not a regular file is refused, so a received checkpoint directory cannot make the run overwrite
another file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from medley.errors import MedleyInputError
from medley.fileio import UnsafePathError, open_no_follow

LOCK_FILE = ".medley.lock"


@dataclass(kw_only=True)
class DirectoryLock:
    """A held lock.

    Attributes:
        path: the lock file.
        handle: the open lock file; closing it releases the lock.
        token: the random token written into it for this run.
    """

    path: Path
    handle: IO[str]
    token: str

    def release(self) -> None:
        if not self.handle.closed:
            self.handle.close()


def _holder(handle: IO[str]) -> dict[str, object]:
    try:
        handle.seek(0)
        holder = json.loads(handle.read(4096) or "{}")
    except (OSError, ValueError, RecursionError):
        return {}
    return holder if isinstance(holder, dict) else {}


def pid_alive(pid: object) -> bool:
    """Whether process ``pid`` (a positive int; anything else is not) exists on this machine."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refuse(directory: Path, path: Path, holder: dict[str, object]) -> MedleyInputError:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    return MedleyInputError(
        f"--checkpoint-dir {directory}: another run ({who}) is using it ({path}); wait for that run to "
        "end, stop it, or choose another --checkpoint-dir")


def acquire(directory: Path) -> DirectoryLock:
    """Lock ``directory`` (created if needed) for this process, or raise :class:`MedleyInputError`
    naming the live holder."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = os.fdopen(open_no_follow(path, os.O_RDWR | os.O_CREAT), "r+")
    except UnsafePathError as err:
        raise MedleyInputError(
            f"--checkpoint-dir {directory}: {path} {err.strerror}; delete {path} (medley creates its own) "
            "or choose another --checkpoint-dir") from None
    except OSError as err:
        raise MedleyInputError(
            f"--checkpoint-dir {directory}: cannot create {path} ({err.strerror}); choose another "
            "--checkpoint-dir") from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _holder(handle)
            handle.close()
            raise _refuse(directory, path, holder) from None
        holder = _holder(handle)  # no flock here: the pid decides
        if holder.get("host") == socket.gethostname() and holder.get("pid") != os.getpid() and pid_alive(
                holder.get("pid")):
            handle.close()
            raise _refuse(directory, path, holder) from None
    token = secrets.token_hex(16)
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": token}) + "\n")
    handle.flush()
    os.fsync(handle.fileno())  # a shared file system shows it to the other nodes
    return DirectoryLock(path=path, handle=handle, token=token)


def read_token(directory: Path) -> str | None:
    """The token in ``directory``'s lock file as this process sees it (None: no readable file)."""
    try:
        with os.fdopen(open_no_follow(Path(directory) / LOCK_FILE, os.O_RDONLY), "r") as handle:
            token = _holder(handle).get("token")
    except OSError:
        return None
    return token if isinstance(token, str) else None
