"""How a rank ends: with its launcher, or when a step hangs.

A rank's parent is the process that started it: torchrun's agent, ``medley train --local-ranks``
(spawn) or the fork server of ``medley train`` (which lives on while its ranks do).
:func:`die_with_parent` asks Linux to kill the rank when its parent dies (``PR_SET_PDEATHSIG``;
elsewhere a thread watches the parent pid) and watches the launcher's pid too, so a ``kill -9``
of the launcher does not leave ranks training and waiting forever.

:class:`StepWatchdog` ends a rank whose step outlives ``--step-timeout`` with one line (and, with
``--debug``, every thread's stack): a mismatched collective never times out on gloo. Each phase
has its limit (:class:`PhaseTimeouts`: the first step, which compiles and allocates, the steady
steps, checkpoint saves), and the process group's own timeout is longer than every one of them
(:func:`process_group_timeout_s`): a hang is named by the watchdog's line, never by NCCL's or
gloo's timeout first.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from medley.errors import debug_enabled
from medley.runtime.lock import pid_alive

if TYPE_CHECKING:
    from medley.runtime.config import LoggingConfig

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_PR_SET_PDEATHSIG = 1
_PARENT_POLL_S = 0.5
# The C-level faulthandler timer ends a rank the Python watchdog cannot reach (a thread holding
# the GIL in a hang) this long after the timeout.
_BACKSTOP_S = 10.0
_DEBUG_DELAY_S = 0.5  # with --debug the stacks follow the one line
# The process group's timeout is this much longer than the longest watched phase, and this long
# when no phase is watched (torch's own default for gloo and NCCL).
PROCESS_GROUP_MARGIN_S = 300.0
UNWATCHED_PROCESS_GROUP_S = 1800.0


@dataclass(kw_only=True, frozen=True)
class PhaseTimeouts:
    """The watchdog's limit per phase of a run, each in seconds (None: that phase is not watched).

    Attributes:
        first_step_s: the first step of a run (or of a resumed run): compiling, allocating, the
            first collectives' connections (``--first-step-timeout``).
        step_s: every later step (``--step-timeout``).
        checkpoint_s: each checkpoint save (``--checkpoint-timeout``).
    """

    first_step_s: float | None
    step_s: float | None
    checkpoint_s: float | None

    def longest_s(self) -> float | None:
        """The longest limit of a watched phase; None when none is watched."""
        return max((t for t in (self.first_step_s, self.step_s, self.checkpoint_s) if t is not None),
                   default=None)


def phase_timeouts(logging: LoggingConfig) -> PhaseTimeouts:
    """The phase limits a run's ``[logging]`` settings give."""
    return PhaseTimeouts(first_step_s=logging.first_step_timeout_s, step_s=logging.step_timeout_s,
                         checkpoint_s=logging.checkpoint_timeout_s)


def process_group_timeout_s(timeouts: PhaseTimeouts) -> float:
    """The process group's timeout: :data:`PROCESS_GROUP_MARGIN_S` past the longest watched phase
    (so the watchdog, with its one line, fires first), :data:`UNWATCHED_PROCESS_GROUP_S` when no
    phase is watched."""
    longest = timeouts.longest_s()
    return UNWATCHED_PROCESS_GROUP_S if longest is None else longest + PROCESS_GROUP_MARGIN_S


def die_with_parent(launcher_pid: int | None = None) -> None:
    """Kill this process when its parent dies (Linux: ``PR_SET_PDEATHSIG``; elsewhere a thread
    watches the parent pid) and, when ``launcher_pid`` is another process (ranks forked by the
    fork server, whose parent outlives the launcher while they hold its pipe), when that one dies."""
    parent = os.getppid()
    watched = {launcher_pid} if launcher_pid not in (None, parent) else set()
    if not _parent_death_signal(parent):
        watched.add(parent)
    for pid in watched:
        threading.Thread(target=_watch_pid, args=(pid,), name=f"medley-watch-{pid}", daemon=True).start()


def _parent_death_signal(parent: int) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request
        os._exit(1)
    return True


def _watch_pid(pid: int) -> None:
    """Exit this process once ``pid`` has ended: a pidfd wait where there is one, else a poll."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has ended
        os._exit(1)
    while pid_alive(pid):
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


class StepWatchdog:
    """Ends the process when a step runs longer than ``timeout_s`` (armed per step; :meth:`arm`
    may give a phase its own limit and name)."""

    def __init__(self, timeout_s: float, *, rank: int) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self.limit_s, self.what, self.flag = timeout_s, "", "--step-timeout"
        self.step: int | None = None
        self.deadline: float | None = None
        self.cond = threading.Condition()
        self.closed = False
        self.debug = debug_enabled()
        self.sink: IO[str] = _stderr_with_fd() if self.debug else open(os.devnull, "w")  # noqa: SIM115
        threading.Thread(target=self._watch, name="medley-step-watchdog", daemon=True).start()

    def arm(self, step: int, *, timeout_s: float | None = None, what: str | None = None,
            flag: str = "--step-timeout") -> None:
        """Watch ``step`` for ``timeout_s`` (default: the watchdog's); ``what`` names the phase in
        the line (default ``step <step>``) and ``flag`` the setting that sets its limit."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self.cond:
            self.step, self.deadline = step, time.monotonic() + limit
            self.limit_s, self.what, self.flag = limit, what or f"step {step}", flag
            self.cond.notify()
        delay = _DEBUG_DELAY_S if self.debug else _BACKSTOP_S
        faulthandler.dump_traceback_later(limit + delay, exit=True, file=self.sink)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self.cond:
            self.deadline = None
            self.cond.notify()

    def close(self) -> None:
        """Disarm and end the watching thread."""
        self.disarm()
        with self.cond:
            self.closed = True
            self.cond.notify()
        if not self.debug:
            self.sink.close()

    def _watch(self) -> None:
        with self.cond:
            while not self.closed:
                if self.deadline is None:
                    self.cond.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                self._fire()
                return

    def _fire(self) -> None:
        message = (f"rank {self.rank}: {self.what or f'step {self.step}'} ran longer than {self.flag} "
                   f"{self.limit_s:g} s (a rank stopped or waits in another collective)")
        if self.debug:  # faulthandler prints every thread's stack and exits
            print(f"error: {message}; the stacks follow", file=sys.stderr, flush=True)
            return
        if os.environ.get(ERROR_FILE_ENV):  # the launcher reports it in its one line
            get_error_handler().record_exception(TimeoutError(message))
        else:
            print(f"error: {message}; rerun with --debug for the stacks", file=sys.stderr, flush=True)
        os._exit(1)


def _stderr_with_fd() -> IO[str]:
    """sys.stderr when it is a real file (faulthandler writes to a descriptor), else the process's
    original stderr (a captured or redirected sys.stderr has no descriptor)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__
