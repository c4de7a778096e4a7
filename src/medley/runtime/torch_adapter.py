"""Every torch API the runtime touches that is private or differs across the torch range medley
supports (2.11 to 2.13, pyproject.toml), in one place.

* The split backward of zero-bubble schedules: torch's ``pipelining._backward`` computes the
  input gradient first and keeps the autograd intermediates that the weight gradient needs later.
* FSDP2's per-parameter-group reduce-scatter, driven by medley at its REDUCE_GRAD actions instead
  of by FSDP's autograd hooks (as torch's own ``PipelineStage.perform_reduce_grad`` does).
* DTensor's shard sizes and offsets at a mesh coordinate (:func:`shard_at`): what a rank's shard
  of the seeded initialisation or of a checkpoint holds (:mod:`medley.runtime.materialize`), and
  what DCP saves.
* The cache of torch's selective checkpoint contexts, kept across reruns
  (:func:`rerunnable_selective_contexts`).
* ``torch.compile``'s switches (:mod:`medley.runtime.torch_compile`): whether dynamo runs here, and
  AOTAutograd's buffer donation, off where a compiled backward runs twice.
* The dry run's (:mod:`medley.dryrun.ranks`): the fake process group's store, fake tensors and
  storage identity.

What differs between 2.11, 2.12 and 2.13 (read from each release's wheel on PyPI; :data:`INTRODUCED`)
goes through a function here that uses torch's own API where the running torch has it and a fallback
with the same semantics where it does not: :func:`ordered_group`, :func:`all_gather_single`,
:func:`reduce_scatter_single`, :func:`reduce_scatter_unused_params` and the split backward's
:func:`backward_input` / :func:`backward_weight`. ``MEDLEY_TORCH_FALLBACKS=1`` takes every
fallback on any torch, so that CI (torch 2.13) runs them (tests/runtime/test_torch_compat.py).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.utils.checkpoint import _CachedTorchDispatchMode, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


FALLBACKS_ENV = "MEDLEY_TORCH_FALLBACKS"

# Where the running torch lacks a behaviour medley relies on, the release that brought it (read
# from the torch 2.11.0, 2.12.0 and 2.13.0 wheels' sources on PyPI); the oldest supported is 2.11.
INTRODUCED: dict[str, str] = {
    "dist.new_group(sort_ranks=False): a group's ranks in the caller's order": "2.12",
    "stage_backward_input: one gradient per input, None where it needs none": "2.12",
    "FSDPState._fsdp_param_groups (a list; before it, one _fsdp_param_group)": "2.12",
    "dist.all_gather_single, dist.reduce_scatter_single (the *_tensor names deprecated)": "2.13",
    "FSDPModule.set_reduce_scatter_unused_params": "2.13",
    "selective checkpoint cache: one dict per op by call index (before: a list read by pop(0))": "2.13",
    "stage_backward_weight: one edge per node output, saved gradients clamped": "2.13",
}


def fallbacks_forced() -> bool:
    """Whether ``MEDLEY_TORCH_FALLBACKS=1`` asks for every fallback, whatever this torch has."""
    return os.environ.get(FALLBACKS_ENV) == "1"


def _native(present: bool) -> bool:
    return present and not fallbacks_forced()


def _torch_at_least(major: int, minor: int) -> bool:
    return torch.__version__ >= (major, minor)  # torch's TorchVersion compares with tuples


@contextlib.contextmanager
def _ranks_kept_in_order() -> Iterator[None]:
    """torch before 2.12 sorts a new group's ranks with the builtin ``sorted`` (the only call of it
    on ``new_group``'s path); shadowed in that module for the call, the group keeps the caller's
    order, as ``sort_ranks=False`` does. :func:`ordered_group` checks the result."""
    if "sorted" in vars(c10d):
        raise RuntimeError("torch.distributed.distributed_c10d defines its own `sorted`: ordered_group's "
                           "fallback does not apply to this torch")
    c10d.sorted = list  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del c10d.sorted  # type: ignore[attr-defined]


def ordered_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks, sort_ranks=False)``: group rank i is ``ranks[i]`` (collective over
    the world, as ``new_group`` is). Before torch 2.12, groups are made with their ranks unsorted
    (:func:`_ranks_kept_in_order`) and torch's own rank map is checked against ``ranks``."""
    ranks = list(ranks)
    if _native("sort_ranks" in inspect.signature(dist.new_group).parameters):
        return dist.new_group(ranks, sort_ranks=False)
    with _ranks_kept_in_order():
        group = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        made = dist.get_process_group_ranks(group)
        if made != ranks or group.rank() != ranks.index(dist.get_rank()):
            raise RuntimeError(f"a group of ranks {ranks} was made with ranks {made} in group order: this "
                               "torch's new_group sorts elsewhere; medley needs torch's sort_ranks=False")
    return group


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> Any:
    """``dist.all_gather_single`` (torch 2.13); before it, ``dist.all_gather_into_tensor``, the same
    collective under its older name (2.13 keeps it, deprecated). Called through ``dist`` at call
    time, so a wrapper of either name (tests/runtime/zero_bytes_worker.py) sees it."""
    if _native(hasattr(dist, "all_gather_single")):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """``dist.reduce_scatter_single`` (torch 2.13); before it, ``dist.reduce_scatter_tensor``."""
    if _native(hasattr(dist, "reduce_scatter_single")):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


_ZERO_FILLED: weakref.WeakSet[FSDPModule] = weakref.WeakSet()


def reduce_scatter_unused_params(unit: FSDPModule) -> None:
    """Every reduce-scatter of ``unit`` (not its submodules) includes each of its parameters, with a
    zero gradient where backward gave none, so that every rank issues the same collective.
    torch 2.13: ``set_reduce_scatter_unused_params(True, recurse=False)``. Before it FSDP2 leaves
    such a parameter out of the reduce-scatter (or skips it when no parameter has a gradient);
    :func:`fsdp_reduce_grad` then gives each a zero gradient first, which FSDP reduces as it reduces
    any gradient: the same collective and the same result as torch 2.13's zero (both
    ``zeros_like`` of the unsharded parameter). What differs: the fallback works only for
    reduce-scatters that medley issues (:func:`fsdp_reduce_grad`), not ones FSDP's own hooks issue,
    which medley keeps disabled."""
    if _native(hasattr(FSDPModule, "set_reduce_scatter_unused_params")):
        unit.set_reduce_scatter_unused_params(True, recurse=False)
    else:
        _ZERO_FILLED.add(unit)


def backward_input(
    outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
    weights: Iterable[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """Input gradients only (one per input, None where an input needs none, as torch 2.12 returns
    them; torch 2.11 returns those of the inputs that need one only); returns them and the state
    :func:`backward_weight` needs."""
    dinputs, state = stage_backward_input(outputs, output_grads, inputs, iter(weights))
    if len(dinputs) != len(inputs):
        given = iter(dinputs)
        dinputs = tuple(next(given) if x.requires_grad else None for x in inputs)
    return dinputs, state


def backward_weight(weights: Iterable[torch.nn.Parameter], state: list[dict[str, Any]]) -> None:
    """Weight gradients from the state saved by :func:`backward_input`, accumulated into ``.grad``.

    torch runs one ``autograd.grad`` per parameter group, and each call reruns every checkpointed
    block it crosses: a recomputing stage then ran its blocks' forward once per group (9 times
    per block of the tiny model). The groups are merged into one call, so the rerun happens once;
    each intermediate is listed once, its saved gradient clamped as torch clamps a group's. torch
    before 2.13 neither clamps (a gradient then counts again through each listed descendant) nor
    keeps a node's outputs apart (2.11 sums them into output 0): :func:`_weight_grads` does the
    2.13 computation there."""
    merged: dict[str, list[Any]] = {"params": [], "intermediates": [], "grads": []}
    seen: set[int] = set()
    for group in state:
        merged["params"] += group["params"]
        for intermediate, grads in zip(group["intermediates"], group["grads"], strict=True):
            if id(intermediate) not in seen:
                seen.add(id(intermediate))
                merged["intermediates"].append(intermediate)
                merged["grads"].append(grads)
    if not merged["params"]:
        return
    if _native(_torch_at_least(2, 13)):
        stage_backward_weight(iter(weights), [merged])
    else:
        _weight_grads(list(weights), merged)


def _weight_grads(weights: list[torch.nn.Parameter], group: dict[str, list[Any]]) -> None:
    """torch 2.13's weight pass of one parameter group, on autograd's public API: one gradient edge
    per (intermediate node, output) with a saved gradient; each intermediate's incoming gradient
    replaced by the saved one (clamped) when there are several, so that none counts twice."""
    edges, grads = [], []
    for intermediate, saved in zip(group["intermediates"], group["grads"], strict=True):
        for i, grad in enumerate(saved):
            if grad is not None:
                edges.append(GradientEdge(intermediate, i))
                grads.append(grad)
    if not edges:
        return
    handles = []
    if len(group["intermediates"]) > 1:
        handles = [intermediate.register_prehook(lambda _incoming, kept=saved: kept)
                   for intermediate, saved in zip(group["intermediates"], group["grads"], strict=True)]
    try:
        dweights = torch.autograd.grad(edges, tuple(GradientEdge(node, 0) for node in group["params"]),
                                       grad_outputs=grads)
    finally:
        for handle in handles:
            handle.remove()
    by_node = {get_gradient_edge(w).node: w for w in weights if w.requires_grad}
    for node, dweight in zip(group["params"], dweights, strict=True):
        weight = by_node[node]
        if weight.grad is None:
            weight.grad = dweight
        else:
            weight.grad += dweight


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The parameter groups of an FSDP unit: a list from torch 2.12, one group (or None) before."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


def fsdp_reduce_grad(module: FSDPModule) -> None:
    """Reduce-scatter the accumulated unsharded gradients of one FSDP unit, now.

    Gradient sync stays disabled between these calls, so FSDP's hooks only accumulate; this
    issues exactly one reduce-scatter per unit, at the point the schedule chose.
    """
    module.set_requires_gradient_sync(True, recurse=False)
    try:
        if module in _ZERO_FILLED:
            _zero_unused_grads(module)
        for group in fsdp_param_groups(module):
            group.post_backward()
            group.finalize_backward()
            group._training_state = TrainingState.IDLE
    finally:
        module.set_requires_gradient_sync(False, recurse=False)


def _zero_unused_grads(module: FSDPModule) -> None:
    """A zero gradient for each gathered parameter of ``module`` that received none (the fallback of
    :func:`reduce_scatter_unused_params`; the parameters torch 2.13 reduces as zeros)."""
    for group in fsdp_param_groups(module):
        for fp in group.fsdp_params:
            if not hasattr(fp, "_unsharded_param") or fp.unsharded_accumulated_grad is not None:
                continue
            param = fp.unsharded_param
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)


def fsdp_unsharded_params(module: FSDPModule) -> list[torch.nn.Parameter]:
    """The unsharded parameter objects of an FSDP unit. FSDP keeps these objects across reshard
    and unshard (only their storage is freed and refilled), so autograd graphs that saved them
    stay valid once the unit is gathered again."""
    return [fp.unsharded_param for group in fsdp_param_groups(module) for fp in group.fsdp_params]


def fsdp_unsharded_grads(module: FSDPModule) -> list[torch.Tensor | None]:
    """The unsharded gradients an FSDP unit holds before its reduce-scatter: the parameter's own
    ``.grad``, or the copy FSDP2 accumulates in the reduce dtype when that differs from the
    parameter dtype (bf16 weights, fp32 reduction: the parameter's ``.grad`` is then freed)."""
    return [fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None
            else fp.unsharded_param.grad
            for group in fsdp_param_groups(module) for fp in group.fsdp_params]


class _KeptAfterRead(dict):
    """One op's cached outputs (by call index) that a read during a rerun does not drop: a split
    backward (B, then W: two autograd calls) reruns a checkpointed block twice, and torch's cache
    otherwise refuses the second rerun. The entries go with the block's autograd graph."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:  # the forward writes each entry once; a rerun's write only marks it read
            super().__setitem__(key, value)


class _ReplayedPerRerun(list):
    """Before torch 2.13 the cache holds one list per op, in call order, that a rerun reads with
    ``pop(0)``: here a read returns the rerun's next entry and keeps it; each rerun starts at the
    first (:class:`_RerunCached`), wherever the previous one stopped (early stop)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0

    def pop(self, index: int = -1) -> Any:
        if index != 0:
            return super().pop(index)
        self.read += 1
        return self[self.read - 1]


class _RerunCached(_CachedTorchDispatchMode):
    """torch's recompute-side mode (before 2.13) whose every entry (each rerun) reads the cache
    from its first entries again."""

    def __enter__(self) -> Any:
        for entries in self.storage.values():
            entries.read = 0
        return super().__enter__()


def rerunnable_selective_contexts(policy: Any) -> tuple[Any, Any]:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`` whose shared cache
    (the modes' ``storage``, private) keeps its entries after a rerun reads them (torch 2.13: one
    dict per op by call index; before: one list per op, :class:`_ReplayedPerRerun`)."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    if isinstance(cached.storage.default_factory(), dict):
        storage: defaultdict[Any, Any] = defaultdict(_KeptAfterRead)
    else:
        storage = defaultdict(_ReplayedPerRerun)
        cached.__class__ = _RerunCached
    caching.storage = cached.storage = storage
    return caching, cached


def dynamo_supported() -> bool:
    """Whether ``torch.compile`` can run in this Python and torch build."""
    from torch._dynamo import is_dynamo_supported

    return is_dynamo_supported()


def keep_backward_buffers() -> None:
    """AOTAutograd stops donating a compiled backward's saved buffers, for this process (read
    when a module is traced): a zero-bubble rank runs one compiled backward twice (B, then W)."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


def fake_tensor_mode() -> FakeTensorMode:
    """A mode whose tensors have shapes and dtypes but no storage bytes (real inputs allowed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_store() -> torch.distributed.Store:
    """The store of torch's fake process group, with its ``"fake"`` backend registered (imported
    here, by the dry run only: torch's testing package is no import of a training rank)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def storage_id(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` views (views of one storage share it; fake storages too)."""
    return tensor.untyped_storage()._cdata


def shard_at(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
             placements: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes and global offsets of the shard of a DTensor of ``shape`` and ``placements`` at
    ``coordinate`` of a mesh of ``mesh_shape`` (torch's own computation, which DCP's save planner
    runs for the rank it is on)."""
    return _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)

