"""Bytes the process has allocated right now, from the C allocator (glibc ``mallinfo2``).

torch's CPU tensors live in ``malloc`` memory (large ones in ``mmap`` blocks that ``malloc`` hands
out and returns), so the in-use bytes of the arena plus the mmap'd blocks count every live
tensor, whatever holds it. Deltas of this figure around a forward pass give the activation bytes
that pass leaves alive; Python objects add a few KB of noise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import statistics
from collections.abc import Iterable


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


@functools.cache
def _mallinfo2() -> ctypes._CFuncPtr | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return fn


def quiet_median(samples: Iterable[float]) -> float:
    """Median of the faster half of ``samples``: on a shared machine other jobs only add time, so
    the slow half says more about them than about the code timed."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("quiet_median of no samples")
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])


def allocated_bytes() -> int | None:
    """In-use heap bytes (small blocks plus mmap'd blocks), or None without glibc >= 2.33."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)
