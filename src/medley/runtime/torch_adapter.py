"""Every private torch API the runtime touches, in one place (pinned to torch 2.13.0).

* The split backward of zero-bubble schedules: torch's ``pipelining._backward`` computes the
  input gradient first and keeps the autograd intermediates that the weight gradient needs later.
* FSDP2's per-parameter-group reduce-scatter, driven by medley at its REDUCE_GRAD actions instead
  of by FSDP's autograd hooks (as torch's own ``PipelineStage.perform_reduce_grad`` does).
* DTensor's shard sizes and offsets at a mesh coordinate (:func:`shard_at`): what a rank's shard
  of the seeded initialisation or of a checkpoint holds (:mod:`medley.runtime.materialize`), and
  what DCP saves.
* The cache of torch's selective checkpoint contexts, kept across reruns
  (:func:`rerunnable_selective_contexts`).
* ``torch.compile``'s switches (:mod:`medley.runtime.compile`): whether dynamo runs here, and
  AOTAutograd's buffer donation, off where a compiled backward runs twice.
* The dry run's (:mod:`medley.runtime.dry_run`): the fake process group's store, fake tensors and
  storage identity.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.utils.checkpoint import create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


def backward_input(
    outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
    weights: Iterable[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """Input gradients only; returns them and the state :func:`backward_weight` needs."""
    return stage_backward_input(outputs, output_grads, inputs, iter(weights))


def backward_weight(weights: Iterable[torch.nn.Parameter], state: list[dict[str, Any]]) -> None:
    """Weight gradients from the state saved by :func:`backward_input`, accumulated into ``.grad``.

    torch runs one ``autograd.grad`` per parameter group, and each call reruns every checkpointed
    block it crosses: a recomputing stage then ran its blocks' forward once per group (9 times
    per block of the tiny model). The groups are merged into one call, so the rerun happens once;
    each intermediate is listed once, its saved gradient clamped as torch clamps a group's."""
    merged: dict[str, list[Any]] = {"params": [], "intermediates": [], "grads": []}
    seen: set[int] = set()
    for group in state:
        merged["params"] += group["params"]
        for intermediate, grads in zip(group["intermediates"], group["grads"], strict=True):
            if id(intermediate) not in seen:
                seen.add(id(intermediate))
                merged["intermediates"].append(intermediate)
                merged["grads"].append(grads)
    stage_backward_weight(iter(weights), [merged] if merged["params"] else [])


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    return list(module._get_fsdp_state()._fsdp_param_groups)


def fsdp_reduce_grad(module: FSDPModule) -> None:
    """Reduce-scatter the accumulated unsharded gradients of one FSDP unit, now.

    Gradient sync stays disabled between these calls, so FSDP's hooks only accumulate; this
    issues exactly one reduce-scatter per unit, at the point the schedule chose.
    """
    module.set_requires_gradient_sync(True, recurse=False)
    try:
        for group in fsdp_param_groups(module):
            group.post_backward()
            group.finalize_backward()
            group._training_state = TrainingState.IDLE
    finally:
        module.set_requires_gradient_sync(False, recurse=False)


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


def rerunnable_selective_contexts(policy: Any) -> tuple[Any, Any]:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`` whose shared cache
    (the modes' ``storage``, private) keeps its entries after a rerun reads them."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    storage: defaultdict[Any, _KeptAfterRead] = defaultdict(_KeptAfterRead)
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

