"""CPU use around a block of work: the whole machine's, this process tree's, and the rest (other
users of a shared machine), from Linux's ``/proc/stat`` and ``getrusage``."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CpuUse:
    """CPU time over a run: the whole machine's, this process tree's, and the rest (other users).

    Attributes:
        wall_s: duration.
        machine_cores: busy cores of the machine, on average.
        own_cores: cores used by this process and its descendants, on average.
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


def _tree_ticks(root: int) -> dict[int, int]:
    """CPU clock ticks (user + system) of every live descendant of ``root``, by pid."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    tree, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - tree
        tree |= frontier
    return {pid: ticks[pid] for pid in tree}


class _TreeSampler(threading.Thread):
    """Samples the CPU time of this process's descendants until stopped: ranks started through a
    fork server are its children, not ours, so ``getrusage`` never counts them."""

    def __init__(self, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.first = _tree_ticks(os.getpid())  # what live descendants had used before the block
        self.last = dict(self.first)

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.last.update(_tree_ticks(os.getpid()))

    def seconds(self) -> float:
        self.stopped.set()
        self.join()
        self.last.update(_tree_ticks(os.getpid()))
        ticks = sum(t - self.first.get(pid, 0) for pid, t in self.last.items())
        return ticks / os.sysconf("SC_CLK_TCK")


def _self_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


@contextlib.contextmanager
def cpu_meter() -> Iterator[list[CpuUse]]:
    """Measure CPU use around a block; the result is appended to the list. This process tree's
    share counts this process and every descendant (sampled every 0.1 s: a process living less
    than that may be missed)."""
    out: list[CpuUse] = []
    sampler = _TreeSampler()
    sampler.start()
    wall, busy, own = time.perf_counter(), _busy_seconds(), _self_seconds()
    yield out
    elapsed = time.perf_counter() - wall
    own_s = _self_seconds() - own + sampler.seconds()
    out.append(
        CpuUse(wall_s=elapsed, machine_cores=(_busy_seconds() - busy) / elapsed, own_cores=own_s / elapsed)
    )
