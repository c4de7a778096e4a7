"""Counting the host synchronisations of a training rank, by step (importable by the launched ranks).

A host sync is a call that, on CUDA, makes the host wait until the device has run what was queued:
a tensor's value read on the host (``item``, ``tolist``, ``numpy``, ``float``/``int``/``bool``/
``__index__`` of a tensor), a copy to the host (``cpu``), or an explicit wait
(``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``). On CPU these cost little, but the
calls are the same, so counting them on CPU says how often a CUDA run would wait. Each call is
attributed to the innermost medley source file and function on the stack (``runtime/train.py:_step``),
so that a test can tell the training loop's from the pipeline executor's.

:func:`count_after_step` is a ``TrainHooks.on_step`` hook: at the first call it starts counting
(the run's first step, which compiles and allocates, is not counted), and after every step it
writes the rank's counts so far, one entry per step, to ``<directory>/rank<R>.json``.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
from pathlib import Path

import torch

_TENSOR_METHODS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")
_MEDLEY = os.sep + "medley" + os.sep
TORCH_OPTIM = os.sep.join(("", "torch", "optim", ""))


class HostSyncs:
    """Patches torch so that every host-sync call is counted, by the medley function it came from."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.inside = threading.local()
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        for name in _TENSOR_METHODS:
            setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), f"Tensor.{name}"))
        torch.cuda.synchronize = self._wrap(torch.cuda.synchronize, "cuda.synchronize")
        torch.cuda.Event.synchronize = self._wrap(torch.cuda.Event.synchronize, "Event.synchronize")
        self.installed = True

    def _wrap(self, original, what: str):  # noqa: ANN001, ANN202 - any callable
        @functools.wraps(original)
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            main = threading.current_thread() is threading.main_thread()
            if main and not getattr(self.inside, "on", False):
                self.counts[f"{_caller()} {what}"] += 1
                self.inside.on = True
                try:
                    return original(*args, **kwargs)
                finally:
                    self.inside.on = False
            return original(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        """The counts since the last call."""
        counts, self.counts = dict(self.counts), collections.Counter()
        return counts


def _caller() -> str:
    """The innermost frame in medley's sources, as ``runtime/train.py:_step``; ``other`` if none.
    A call straight from ``torch.optim`` is named ``torch.optim`` whatever called it: torch keeps
    an optimizer's step count on the host (a CPU tensor, unless fused or capturable, when it
    reads it on the device), so its reads wait for nothing."""
    frame = sys._getframe(2)
    if TORCH_OPTIM in frame.f_code.co_filename:
        return "torch.optim"
    while frame is not None:
        path = frame.f_code.co_filename
        if _MEDLEY in path and "tests" + os.sep not in path:
            return f"{path.rsplit(_MEDLEY, 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


_SYNCS = HostSyncs()
_STEPS: list[dict] = []


def count_after_step(directory: str, step: int) -> None:
    """``TrainHooks.on_step`` (bind ``directory`` with functools.partial): the host syncs of each
    step after the first, written to ``<directory>/rank<R>.json`` as ``[{"step", "syncs"}]``."""
    if not _SYNCS.installed:
        _SYNCS.install()
        return
    _STEPS.append({"step": step, "syncs": _SYNCS.take()})
    path = Path(directory) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(_STEPS))
