"""Optimizer choice, learning-rate schedule and the state tensors a checkpoint restores."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from medley.errors import MedleyInputError
from medley.runtime.settings import OptimizerConfig

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant", "wsd")
ADAMW_BETAS = (0.9, 0.95)


def optimizer_class(name: str, *, lr: float, weight_decay: float,
                    device: torch.device | str = "cpu") -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class and its arguments for ``name`` (``adamw`` or ``sgd``) on
    ``device`` (where the parameters live).

    AdamW on CUDA is torch's ``fused`` kernel, as torchtitan's default: one kernel for the whole
    update of a bucket (``foreach`` launches one per operation). Elsewhere, and for SGD, torch's
    multi-tensor (``foreach``) implementation: one dispatch per operation over a bucket's tensors
    instead of one per tensor. torch picks ``foreach`` by itself on CUDA only; on CPU, over FSDP2's
    DTensor shards, the per-tensor loop took 5x longer (tiny model: 7.9 ms against 1.5 ms a step).
    (torch has a fused CPU AdamW too; it is not used: its update is not the one the CPU equality
    tests and profiles were measured with.)"""
    on_cuda = torch.device(device).type == "cuda"
    if name == "adamw":
        kind = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW, dict(lr=lr, betas=ADAMW_BETAS, eps=1e-8, weight_decay=weight_decay, **kind)
    if name == "sgd":
        return torch.optim.SGD, dict(lr=lr, weight_decay=weight_decay, foreach=True)
    raise MedleyInputError(f"--optimizer '{name}' must be one of {', '.join(OPTIMIZERS)}")


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """Linear warm-up over ``warmup_steps`` (step 0 already takes a non-zero step), then the
    decay from ``lr`` to ``min_lr`` at ``total_steps``: ``cosine``, ``linear``, ``constant`` (none),
    or ``wsd`` (``lr`` until the last ``decay_fraction`` of the steps after warm-up, then linear);
    a ``min_lr`` above ``lr`` is ``lr`` (so ``lr`` 0 changes no weight: an export round trip checks
    bit for bit with it)."""
    min_lr = min(min_lr, lr)
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        decay = max(0.0, progress - (1.0 - decay_fraction)) / decay_fraction
        return lr - (lr - min_lr) * min(1.0, decay)
    raise MedleyInputError(f"--lr-schedule '{schedule}' must be one of {', '.join(SCHEDULES)}")


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """The learning rate of every step of a run, fixed at its start and recorded in its
    checkpoints, so that a resume continues the same curve (``extend_schedule`` to change it).

    Attributes:
        kind: ``cosine``, ``linear``, ``constant`` or ``wsd`` (:func:`lr_at`).
        lr: peak learning rate; min_lr: the rate at the decay's end.
        warmup_steps: linear warm-up steps; steps: the step at which the decay ends.
        decay_fraction: ``wsd``'s decaying share of the steps after warm-up.
    """

    kind: str
    lr: float
    min_lr: float
    warmup_steps: int
    steps: int
    decay_fraction: float

    @classmethod
    def of(cls, opt: OptimizerConfig) -> LrSchedule:
        # Only wsd reads the decay fraction: another kind records 1.0, so that a --decay-fraction
        # it ignores does not make its checkpoints' schedule differ.
        fraction = opt.decay_fraction if opt.lr_schedule == "wsd" else 1.0
        return cls(kind=opt.lr_schedule, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps,
                   steps=opt.steps, decay_fraction=fraction)

    def at(self, step: int) -> float:
        """The learning rate of ``step`` (counted in applied updates)."""
        return lr_at(step, lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                     total_steps=self.steps, schedule=self.kind, decay_fraction=self.decay_fraction)

    def record(self) -> dict[str, Any]:
        """The fields, as a checkpoint's medley.json keeps them."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """``cosine over 20 steps, lr 0.003 -> 0.0003, 5 warm-up``, the way a resume names it."""
        decay = "" if self.kind == "constant" else f" -> {self.min_lr:g}"
        share = f" (last {self.decay_fraction:g} decaying)" if self.kind == "wsd" else ""
        return (f"{self.kind}{share} over {self.steps} steps, lr {self.lr:g}{decay}, "
                f"{self.warmup_steps} warm-up")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero state for every parameter that has none yet (AdamW's step, exp_avg and
    exp_avg_sq, shaped and sharded like the parameter), so a checkpoint can be loaded into it."""
    if not isinstance(optimizer, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                continue
            optimizer.state[param] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
