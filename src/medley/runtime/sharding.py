"""ZeRO levels of one pipeline stage, driven by the schedule's collective actions.

Each stage's layers are cut into buckets (``PipelineSchedule.bucket_layers``; one bucket by
default). What each action does per level is :mod:`medley.cost.zero_levels`' table, which the
simulator times too: levels 1-3 hold each bucket as an FSDP2 unit sharded over the stage's dp
group, so ``REDUCE_GRAD`` is one reduce-scatter per bucket, ``OPTIM`` steps the shards and the
``UNSHARD`` after it (levels 1-2) or before compute (level 3) is one all-gather per bucket;
level 0 all-reduces a bucket's flattened gradients and steps whole parameters.

Under tensor parallelism (:mod:`medley.runtime.tensor_parallel`) the dp group is that of the
rank's TP rank (the same TP rank of every replica): FSDP2 shards the TP-sharded parameters
(DTensors on the ``tp`` dimension of the pipeline rank's (dp, tp) mesh) over ``dp`` on top, 2-D
as torchtitan does, and level 0 all-reduces their local slices.

Every reduction is a SUM: the loss is already scaled by 1 / global token count, so replicas with
unlike micro-batch counts add up to the single-device gradient (gloo has no PREMUL_SUM).
FSDP's own hooks never communicate: gradient sync is off and nothing reshards by itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from medley.cost.zero_levels import ZeroLevel, fsdp_units, zero_level
from medley.cost.zero_memory import state_bytes_per_param
from medley.runtime.tensor_parallel import is_tp_sharded, local_tensor, replicate_partial_grads
from medley.runtime.torch_adapter import fsdp_reduce_grad, fsdp_unsharded_params, reduce_scatter_unused_params
from medley.runtime.transformer import Decoder, shared_name

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """First row and row count of piece ``index`` of a dim-0 cut into ``parts`` (``torch.chunk``'s
    pieces, as FSDP2 shards a parameter over the dp mesh: the last ones may be short or empty)."""
    chunk = -(-rows // parts)
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk) - start


def bucket_layer_groups(layer_ids: Sequence[int], bucket_layers: Sequence[int] | None) -> list[list[int]]:
    """Cut a stage's global layer indices into consecutive buckets of the given sizes."""
    if not bucket_layers:
        return [list(layer_ids)]
    if sum(bucket_layers) != len(layer_ids) or min(bucket_layers) < 1:
        raise ValueError(f"bucket sizes {tuple(bucket_layers)} must be positive and add up to the "
                         f"stage's {len(layer_ids)} layers")
    groups, start = [], 0
    for size in bucket_layers:
        groups.append(list(layer_ids[start:start + size]))
        start += size
    return groups


@dataclass(kw_only=True)
class ShardedStage:
    """One stage's module with its ZeRO level, buckets and per-bucket optimizers.

    Attributes:
        module: the stage's layers (FSDP2-wrapped for levels 1-3).
        zero: ZeRO level 0..3.
        buckets: parameters per bucket, in bucket order (sharded DTensors for levels 1-3).
        fsdp_units: FSDP unit per bucket (levels 1-3 only).
        dp_groups: per bucket, the process group of its ZeRO group: the holders of its sync
            segment in every replica (:mod:`medley.plan.segments`; for alike replicas the
            stage's dp group), None when the plan has one replica.
        optimizers: one per bucket, so that OPTIM(stage, bucket) steps just that bucket.
        bucket_names: global (plan-independent) name of each parameter, per bucket.
        copies: parameters that copy another stage's (a tied LM head's copy of the embedding):
            their gradient equals the original's once summed, so the norm counts it there only.
        reduce_dtype: the dtype gradients are reduced in (level 0's all-reduce; FSDP2's own
            policy at levels 1-3).
        tp_rank: this rank's place in its TP group: parameters that are not TP-sharded (norms,
            embedding, head) are the same on every TP rank, so only TP rank 0 counts them in the norm.
    """

    module: Decoder
    zero: int
    buckets: list[list[nn.Parameter]]
    fsdp_units: list[FSDPModule]
    dp_groups: list[dist.ProcessGroup | None]
    optimizers: list[torch.optim.Optimizer]
    bucket_names: list[list[str]]
    copies: frozenset[nn.Parameter] = frozenset()
    reduce_dtype: torch.dtype = torch.float32
    tp_rank: int = 0
    # Level 0: gradients already all-reduced this step; a stage may reduce in several windows.
    reduced: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    # Level 3: buckets whose weights are gathered now (compute needs all of them).
    gathered: set[int] = field(default_factory=set)

    @property
    def meaning(self) -> ZeroLevel:
        return zero_level(self.zero)

    @property
    def replicated(self) -> bool:
        """Whether the plan has several replicas (gradients are reduced over ZeRO groups)."""
        return any(group is not None for group in self.dp_groups)

    def dp_group_of(self, param: nn.Parameter) -> dist.ProcessGroup | None:
        """The ZeRO group of the bucket holding ``param``."""
        return next(group for group, params in zip(self.dp_groups, self.buckets, strict=True)
                    if any(p is param for p in params))

    @property
    def sharded(self) -> bool:
        """Whether parameters, their gradients and optimizer state are FSDP2 shards (levels 1-3)."""
        return self.meaning.shards_optimizer

    def unshard(self, bucket: int | None) -> None:
        """All-gather the bucket's weights: before compute (level 3) or after its step (1-2)."""
        if self.sharded:
            for index in self._indices(bucket):
                if index not in self.gathered:  # every member of the dp group agrees on this
                    self.fsdp_units[index].unshard()
                    self.gathered.add(index)

    def reshard(self, bucket: int | None) -> None:
        if self.meaning.gathers_for_compute:
            self._free(bucket)

    def _free(self, bucket: int | None) -> None:
        for index in self._indices(bucket):
            self.fsdp_units[index].reshard()
            self.gathered.discard(index)

    def require_gathered(self, action: str) -> None:
        """Levels 1-3: fail clearly when compute would run on sharded weights (a schedule without
        the UNSHARD it needs would otherwise produce shape errors deep inside FSDP)."""
        missing = sorted(set(range(len(self.buckets))) - self.gathered)
        if self.sharded and missing:
            raise RuntimeError(
                f"{action} runs on a ZeRO-{self.zero} stage whose weight buckets {missing} are not "
                "gathered: the schedule has no UNSHARD before it (level 3) or after the last optimizer "
                "step (levels 1-2). Fix the plan's 'layout.zero' / 'layout.placement' (or the "
                "hand-written schedule)")

    def reduce_grad(self, bucket: int | None) -> None:
        for index in self._indices(bucket):
            if self.sharded:
                fsdp_reduce_grad(self.fsdp_units[index])
            else:
                replicate_partial_grads(self.buckets[index])
                self._all_reduce(self.buckets[index], self.dp_groups[index])

    def optim_step(self, bucket: int | None) -> None:
        for index in self._indices(bucket):
            if not self.sharded:
                for param in self.buckets[index]:
                    param.grad = self.reduced.pop(param, None) if self.replicated else param.grad
            self.optimizers[index].step()
            self.optimizers[index].zero_grad(set_to_none=True)
        if self.meaning.gathers_after_step:
            self._free(bucket)  # stale now: the UNSHARD after the step gathers the updated weights

    def drop_grads(self, bucket: int | None) -> None:
        """OPTIM of a skipped step: the gradients go, weights and optimizer state stay as they are."""
        for index in self._indices(bucket):
            for param in self.buckets[index]:
                self.reduced.pop(param, None)
            self.optimizers[index].zero_grad(set_to_none=True)
        if self.meaning.gathers_after_step:
            self._free(bucket)  # the UNSHARD after the step gathers again, as on an applied step

    def final_grads(self, bucket: int | None = None) -> list[torch.Tensor]:
        """The reduced gradients OPTIM will apply: local shards (DTensors) at levels 1-3, the
        all-reduced full gradients at level 0."""
        return [grad for _, grad in self._final_grads(bucket)]

    def final_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The reduced gradient of one parameter (as :meth:`final_grads` gives it)."""
        return self.reduced.get(param) if not self.sharded and self.replicated else param.grad

    def _final_grads(self, bucket: int | None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        pairs = []
        for index in self._indices(bucket):
            for param in self.buckets[index]:
                grad = self.final_grad(param)
                if grad is not None:
                    pairs.append((param, grad))
        return pairs

    def grad_sq_norm(self, bucket: int | None, *, replica: int) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (fp64): its shards at levels 1-3;
        at level 0 every replica holds the whole gradient, so only replica 0 counts it. A
        tied copy (:attr:`copies`) is counted where its original is; a TP-sharded gradient on
        every TP rank (each holds its own slice), any other on TP rank 0 only."""
        # Summed where the gradients are (a CPU accumulator cannot take CUDA shares in place).
        shares = [] if not self.sharded and replica > 0 else [
            local_tensor(grad).double().square().sum() for param, grad in self._final_grads(bucket)
            if not (param in self.copies or (self.tp_rank > 0 and not is_tp_sharded(grad)))]
        return torch.stack(shares).sum() if shares else torch.zeros((), dtype=torch.float64)

    def grads_finite(self) -> bool:
        """Whether every gradient this rank holds is finite (each replica checks its own copy:
        the norm counts only replica 0's at level 0)."""
        for grad in self.final_grads():
            local = local_tensor(grad)
            if not bool(torch.isfinite(local).all()):
                return False
        return True

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        for grad in self.final_grads():
            grad.mul_(factor)

    def weights(self) -> list[nn.Parameter]:
        """The parameters autograd sees: FSDP's unsharded ones for levels 1-3, so that a split
        backward finds them even if the stage was resharded and gathered again in between."""
        if self.sharded:
            return [p for unit in self.fsdp_units for p in fsdp_unsharded_params(unit)]
        return list(self.module.parameters())

    def trained_weights(self) -> list[nn.Parameter]:
        """The :meth:`weights` that take a gradient (a LoRA stage's adapters; all of them else)."""
        return [p for p in self.weights() if p.requires_grad]

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Full (unsharded, reduced) gradients by global parameter name; a collective at levels 1-3."""
        grads = {}
        for name, param in self._named_params():
            grad = self.reduced.get(param, param.grad)
            if grad is not None:
                grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        return grads

    def named_params(self) -> dict[str, torch.Tensor]:
        """Full parameters by global name; a collective at levels 1-3."""
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for name, p in self._named_params()}

    def named_parameters_local(self) -> list[tuple[str, nn.Parameter]]:
        """(global name, parameter as this rank holds it: a DTensor shard at levels 1-3)."""
        return self._named_params()

    def refresh_gathered(self) -> None:
        """Levels 1-2 keep gathered copies of the weights: re-gather them after the shards changed
        outside an optimizer step (a checkpoint load)."""
        if self.meaning.gathers_after_step:
            for unit in self.fsdp_units:
                unit.reshard()
                unit.unshard()

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for names, params in zip(self.bucket_names, self.buckets, strict=True)
                for name, p in zip(names, params, strict=True)]

    def _indices(self, bucket: int | None) -> range | list[int]:
        return range(len(self.buckets)) if bucket is None else [bucket]

    def _all_reduce(self, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        params = [p for p in params if p.requires_grad]  # a frozen base (LoRA) has no gradient
        if group is None or not params:
            return
        # TP-sharded gradients (DTensors) reduce their local slices: the dp group holds one TP rank.
        grads = [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
                 for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.reduce_dtype)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            # A view of the summed buffer (a copy only to another dtype): the buffer becomes the
            # reduced gradients, as medley.cost.zero_memory books it, not a second copy of them.
            summed = flat[offset:offset + grad.numel()].view_as(grad).to(grad.dtype)
            offset += grad.numel()
            if isinstance(param, DTensor):
                summed = DTensor.from_local(summed, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
            previous = self.reduced.get(param)
            self.reduced[param] = summed if previous is None else previous + summed
            param.grad = None


def shard_stage(
    module: Decoder, *, zero: int, bucket_layers: Sequence[int] | None,
    dp_mesh: DeviceMesh | Sequence[DeviceMesh | None] | None,
    optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any], precision: str = "fp32",
    tp_rank: int = 0, device: torch.device | None = None,
) -> ShardedStage:
    """Apply the stage's ZeRO level to ``module`` and build its optimizers (over the parameter
    shards for levels 1-3, over whole parameters for level 0).

    ``dp_mesh``: the ZeRO group's (dp, tp) mesh's ``dp`` dimension, or one per bucket where the
    buckets belong to sync segments of unlike holders (:mod:`medley.plan.segments`); each holds
    every replica of the plan, so all are of one size.

    ``precision`` (fp32, bf16, fp16) sets the dtypes of :func:`~medley.cost.zero_memory.
    state_bytes_per_param`, which the simulator counts: in half precision, levels 1-3 gather the
    weights in the compute dtype (FSDP2's mixed precision: fp32 shards, half-precision gathered
    copies) and every level reduces gradients in the plan's gradient dtype (fp32 for bf16).

    With one replica (no ``dp_mesh`` or one of size 1) there is nothing to shard: levels 1-3 run
    as level 0 (:func:`~medley.cost.zero_levels.fsdp_units`), whose state
    :mod:`medley.cost.zero_memory` books for them there; FSDP2 over one rank would hold the weights
    twice. The schedule's ZeRO actions then do nothing, as the simulator times them.

    ``device``: where a meta-device ``module`` gets (uninitialised) storage for this rank's shards,
    once TP and FSDP2 have cut it; None leaves it where it is. A stage given a ``device`` or still
    on the meta device holds no gathered copies yet: the caller fills its shards, then gathers them
    (levels 1-2) with :meth:`ShardedStage.unshard`."""
    layers = module.layer_modules()
    groups = bucket_layer_groups(sorted(layers), bucket_layers)
    meshes = list(dp_mesh) if isinstance(dp_mesh, Sequence) else [dp_mesh] * len(groups)
    if len(meshes) != len(groups) or len({1 if m is None else m.size() for m in meshes}) != 1:
        raise ValueError(f"{len(meshes)} ZeRO meshes for {len(groups)} buckets; give one per bucket, "
                         "each over every replica")
    if not fsdp_units(zero, 1 if meshes[0] is None else meshes[0].size()):
        zero = 0
    meaning = zero_level(zero)
    state = state_bytes_per_param(precision)
    mixed = None
    if precision != "fp32":
        mixed = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[state.weight_dtype],
                                     reduce_dtype=TORCH_DTYPES[state.grad_dtype])
    dp_groups = [mesh.get_group() if mesh is not None and mesh.size() > 1 else None for mesh in meshes]
    units: list[FSDPModule] = []
    if meaning.shards_optimizer:
        for group, mesh in zip(groups, meshes, strict=True):
            wrapped = fully_shard([layers[i] for i in group], mesh=mesh, reshard_after_forward=False,
                                  **_policy(mixed))
            units.append(wrapped[0])
        root = fully_shard(module, mesh=meshes[0], reshard_after_forward=False, **_policy(mixed))
        for unit in [*units, root]:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            # Every REDUCE_GRAD is a reduce-scatter, gradient or not: a replica with fewer
            # micro-batches pads its rounds, and a skipped collective would hang its DP group.
            reduce_scatter_unused_params(unit)
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        root.set_is_last_backward(False)
    elif mixed is not None:
        # Without FSDP2, cast each layer's input activations to the compute dtype as FSDP2's
        # mixed precision does (and the pipeline's wire): the residual stream runs in the same
        # dtype at every level (an fp32 embedding output would keep it in fp32 on the first
        # stage), which the bf16 profile and the memory model count.
        for layer in layers.values():
            layer.register_forward_pre_hook(_cast_input(mixed.param_dtype))
        # The norms then see a half-precision input beside their fp32 weight, for which torch
        # warns that its fused kernel does not apply (the composite one computes in fp32).
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    if device is not None:  # after wrapping, so that FSDP2 allocates its shards alone; before the
        module.to_empty(device=device)  # lists below (a meta parameter moved is a new object)
    # Built before any unshard, so that FSDP stages hold (and step) their sharded parameters.
    buckets = [[p for i in group for p in layers[i].parameters()] for group in groups]
    local_name = {p: name for name, p in module.named_parameters()}
    bucket_names = [[shared_name(module.spec, local_name[p]) for p in params] for params in buckets]
    copies = frozenset(p for p, name in local_name.items() if shared_name(module.spec, name) != name)
    # Each bucket's trainable parameters (a frozen base's take no state); a bucket of frozen layers
    # only gets an optimizer of one empty group, whose steps do nothing.
    trained = [[p for p in params if p.requires_grad] for params in buckets]
    optimizers = [optimizer_class(_same_kind_groups(params) or [{"params": []}], **optimizer_kwargs)
                  for params in trained]
    stage = ShardedStage(module=module, zero=zero, buckets=buckets, fsdp_units=units, dp_groups=dp_groups,
                         optimizers=optimizers, bucket_names=bucket_names, copies=copies,
                         reduce_dtype=TORCH_DTYPES[state.grad_dtype], tp_rank=tp_rank)
    if meaning.gathers_after_step and device is None and not _on_meta(module):
        stage.unshard(None)  # weights stay gathered between steps at levels 1-2
    return stage


def _on_meta(module: nn.Module) -> bool:
    return any(local_tensor(p).is_meta for p in module.parameters())


def _same_kind_groups(params: Sequence[nn.Parameter]) -> list[dict[str, list[nn.Parameter]]]:
    """A bucket's parameters as optimizer parameter groups of one kind each (plain tensors, and
    DTensors by mesh and placements): a multi-tensor (``foreach``) step takes one kind at a time
    (a TP stage without ZeRO mixes DTensor blocks with plain norms, embedding and head)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in params:
        key = (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None
        groups.setdefault(key, []).append(param)
    return [{"params": members} for members in groups.values()]


def _cast_input(dtype: torch.dtype) -> Any:
    """A forward pre-hook casting a layer's floating-point input activation to ``dtype``."""

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (args[0].to(dtype), *args[1:])
        return None

    return hook


def _policy(mixed: MixedPrecisionPolicy | None) -> dict[str, MixedPrecisionPolicy]:
    return {} if mixed is None else {"mp_policy": mixed}
