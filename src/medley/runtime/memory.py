"""Peak memory of a rank: CUDA's allocator counter, or live tensor bytes tracked on CPU.

On CPU there is no allocator counter. A probe step runs under :class:`LiveTensorBytes`, a torch
dispatch mode that follows every tensor storage the step creates, plus the storages alive before
it (parameters, gradients, optimizer state, FSDP's gathered buffers), and samples their total
size after every operator; storages resized in place (FSDP frees and refills its gathered
weights that way) count at their current size. Tracking slows a step several-fold, so the probe
is an extra step after the timed ones and no step time includes it; compiled blocks run
eagerly in it (dynamo does not trace under a dispatch mode). (torch's own ``MemTracker``
refuses modules called more than once per step, as pipeline stages are once per micro-batch.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from medley.runtime.sharding import ShardedStage
from medley.runtime.tensor_parallel import local_tensor


class LiveTensorBytes(TorchDispatchMode):
    """Peak of the summed sizes of all live tensor storages while the mode is active."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}
        self.peak = 0
        for tensor in existing:
            self._track(tensor)
        self._sample()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = local_tensor(tensor).untyped_storage()
        key = id(storage)
        if key not in self.storages:
            self.storages[key] = weakref.ref(storage, lambda _, key=key: self.storages.pop(key, None))

    def live(self) -> int:
        """Bytes of the tracked storages alive now."""
        total = 0
        for ref in list(self.storages.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def _sample(self) -> None:
        self.peak = max(self.peak, self.live())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        self._sample()
        return out


def probe_peak_bytes(run_step: Callable[[], None], *, existing: Iterable[torch.Tensor]) -> int:
    """Run ``run_step`` once under :class:`LiveTensorBytes`; its peak live bytes.

    Dynamo does not trace under a Python dispatch mode (a ``fullgraph=True`` block then fails:
    "found no compiled frames"), so blocks compiled with ``--compile`` run eagerly in the probe
    (``torch.compiler.set_stance("force_eager")``): the probe measures the eager step's memory."""
    mode = LiveTensorBytes(existing)
    with torch.compiler.set_stance("force_eager"), mode:
        run_step()
    return mode.peak


def resident_tensors(stages: Iterable[ShardedStage]) -> list[torch.Tensor]:
    """Tensors alive between steps: weights (FSDP2's gathered copies and the shards its optimizers
    step), gradients, reduced gradients, buffers and optimizer state."""
    out: list[torch.Tensor] = []
    for stage in stages:
        # The optimizers' parameters are FSDP2's shards at levels 1-3, which the module no longer
        # lists once its gathered weights are swapped in (levels 1-2 between steps).
        stepped = [p for bucket in stage.buckets for p in bucket]
        params = [*stage.module.parameters(), *stage.weights(), *stepped]
        out += params + [p.grad for p in params if p.grad is not None] + list(stage.reduced.values())
        out += list(stage.module.buffers())
        for optimizer in stage.optimizers:
            for state in optimizer.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def reset_cuda_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device))
