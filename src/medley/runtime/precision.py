"""The precision a run computes in, and fp16's dynamic loss scale.

bf16 and fp16 runs compute under ``torch.autocast`` on fp32 master weights, which the optimizer
steps in fp32; ZeRO-1/2/3 stages gather their weights in the compute dtype and every stage reduces
gradients in the dtype :func:`medley.cost.zero_memory.state_bytes_per_param` names (fp32 for bf16,
fp16 for fp16), as the simulator counts (:func:`medley.runtime.sharding.shard_stage`). fp16 has a
narrow range, so its runs scale the loss
before backward (:class:`LossScaler`, torch ``GradScaler``'s policy: start at 2**16, halve on an
overflow, double after ``growth_interval`` finite steps in a row).

The overflow check is global: every rank's squared gradient norm share and its count of
non-finite gradients go into one fp64 all-reduce over the world (the schedule's ``CLIP`` action,
which fp16 runs always carry), so all ranks take the same decision: apply the step (gradients
unscaled, then clipped, in one multiplication) or skip it on every rank, and move the scale the
same way. Gradients are checked after their reductions, where an overflow on any replica has
reached every replica's copy.

A skipped step changes no weight and no optimizer state (AdamW's step count stays) and, as in
Megatron-LM, does not advance the learning-rate schedule: the schedule's position is the number of
applied updates. The data still advances (batches are a function of the step index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from medley.plan.plan import Plan
from medley.runtime.sharding import ShardedStage
from medley.runtime.tensor_parallel import local_tensor

# An overflow at this scale (gradients that overflow unscaled) is divergence, not a bad scale.
MIN_LOSS_SCALE = 1.0


def choose_dtype(plan: Plan, dtype: str | None, *, on_cuda: bool) -> str:
    """The precision a run computes in: ``dtype`` (``--dtype``) when given; else the plan's on
    CUDA, fp32 on CPU (a CPU run emulates the plan's devices)."""
    if dtype is not None:
        return dtype
    return plan.shared.dtype if on_cuda else "fp32"


@dataclass(kw_only=True)
class LossScaler:
    """fp16's dynamic loss scale (torch ``GradScaler``'s policy), the same on every rank.

    Attributes:
        scale: the loss is multiplied by this before backward.
        backoff: the scale is multiplied by this after a step whose gradients overflowed.
        growth: the scale is multiplied by this after ``growth_interval`` finite steps in a row.
        growth_interval: finite steps in a row before the scale grows.
        good_steps: finite steps since the last overflow or growth.
        skipped_steps: steps skipped (gradients not finite) in the whole run, resumes included.
        skipped_now: whether the current step is skipped.
    """

    scale: float
    backoff: float = 0.5
    growth: float = 2.0
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0
    skipped_now: bool = False

    def update(self, *, finite: bool) -> None:
        """After a step's global gradient check: back off and count a skip, or count a good step."""
        self.skipped_now = not finite
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    @property
    def exhausted(self) -> bool:
        """Gradients overflowed at scale ``MIN_LOSS_SCALE``: no scale helps, training diverged."""
        return self.scale < MIN_LOSS_SCALE

    def state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's ``train.*`` tensors of the scale (loaded in place, then :meth:`load`)."""
        return {"loss_scale": torch.tensor(self.scale, dtype=torch.float64),
                "loss_scale_good_steps": torch.tensor(self.good_steps, dtype=torch.int64)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.scale = float(state["loss_scale"])
        self.good_steps = int(state["loss_scale_good_steps"])


def unscale_and_clip(stages: dict[int, ShardedStage], *, replica: int, device: torch.device,
                     clip_norm: float | None, scaler: LossScaler | None = None) -> torch.Tensor:
    """The ``CLIP`` action: one fp64 all-reduce of the squared gradient norm over the world, then
    every gradient multiplied by ``coef / scale`` with torch ``clip_grad_norm_``'s
    ``coef = min(1, clip / (norm + 1e-6))`` of the unscaled norm (1 without clipping), computed
    on the device as ``clip_grad_norm_`` does: no host sync.

    With a ``scaler`` (fp16), a non-finite gradient on any rank (or a non-finite norm) skips the
    step on every rank: no gradient is touched and the scaler backs off. The count of non-finite
    gradients is made on the device and goes into the same all-reduce; reading its result is the
    one host sync of an fp16 step (the executor must know before the OPTIM actions whether they
    run). Returns this rank's share of the unscaled squared norm (fp64, on ``device``)."""
    scale = 1.0 if scaler is None else scaler.scale
    local = torch.zeros((), dtype=torch.float64, device=device)
    for stage in stages.values():
        local = local + stage.grad_sq_norm(None, replica=replica).to(device)
    if scaler is None:
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    else:
        both = torch.stack([local, nonfinite_count(stages, device=device)])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        total = both[0]
        finite = bool(torch.isfinite(total) & (both[1] == 0))  # the fp16 step's one host sync
        scaler.update(finite=finite)
        if not finite:
            return local / scale**2
    if clip_norm is not None:
        coef = torch.clamp(clip_norm / (total.sqrt() / scale + 1e-6), max=1.0)
        for stage in stages.values():
            stage.scale_grads(coef / scale)
    elif scale != 1.0:
        for stage in stages.values():
            stage.scale_grads(1.0 / scale)
    return local / scale**2


def nonfinite_count(stages: dict[int, ShardedStage], *, device: torch.device) -> torch.Tensor:
    """How many gradient elements this rank holds that are not finite (fp64, on ``device``; each
    replica checks its own copy, as :meth:`ShardedStage.grads_finite` does, without a host sync)."""
    count = torch.zeros((), dtype=torch.float64, device=device)
    for stage in stages.values():
        for grad in stage.final_grads():
            count = count + torch.isfinite(local_tensor(grad)).logical_not().sum().to(device)
    return count
