"""CPU use around a block of work: the whole machine's, this process tree's, and the rest (other
users of a shared machine), from Linux's ``/proc/stat`` and ``getrusage``."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CpuUse:
    """CPU time over a run: the whole machine's, this process tree's, and the rest (other users).

    Attributes:
        wall_s: duration.
        machine_cores: busy cores of the machine, on average.
        own_cores: cores used by this process and its finished children, on average.
    """

    wall_s: float
    machine_cores: float
    own_cores: float

    @property
    def background_cores(self) -> float:
        """The rest: other processes sharing the machine."""
        return max(0.0, self.machine_cores - self.own_cores)


def _busy_seconds() -> float:
    with open("/proc/stat") as handle:
        fields = handle.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def cpu_meter() -> Iterator[list[CpuUse]]:
    """Measure CPU use around a block; the result is appended to the list."""
    out: list[CpuUse] = []
    wall, busy, own = time.perf_counter(), _busy_seconds(), _own_seconds()
    yield out
    elapsed = time.perf_counter() - wall
    out.append(CpuUse(wall_s=elapsed, machine_cores=(_busy_seconds() - busy) / elapsed,
                      own_cores=(_own_seconds() - own) / elapsed))
