"""Rank 0's :class:`~medley.runtime.records.StepRecord` of each step, from the statistics every
rank gathered (:mod:`medley.runtime.step_stats`), and the divergence check on them (every rank
makes it alike, so all stop together)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from medley.errors import MedleyInputError
from medley.plan.plan import Plan
from medley.runtime.config import TrainConfig
from medley.runtime.executor import ACTION_CATEGORIES
from medley.runtime.records import StepRecord
from medley.runtime.step_stats import GatheredStep


@dataclass(kw_only=True)
class RecordMaker:
    """What turns a gathered step into its record.

    Attributes:
        plan: the plan trained.
        config: the run's settings.
        source: the training data (``sample_indices`` of each step's batch).
        sequences: sequences per global batch.
        device_of_rank: the plan device of each global rank.
        rank: this process's global rank (only rank 0 makes records).
        on_cuda: the ranks run on CUDA (peak memory from the allocator's counter).
        fp16: the run scales its loss (records carry the loss scale).
        flops_per_peak: the step's model FLOPs over the plan devices' summed peak (MFU is this over
            the step time); None on CPU.
    """

    plan: Plan
    config: TrainConfig
    source: Any
    sequences: int
    device_of_rank: list[int]
    rank: int
    on_cuda: bool
    fp16: bool
    flops_per_peak: float | None

    def record(self, gathered: GatheredStep, *, exhausted: bool, skipped_steps: int) -> StepRecord | None:
        """The step's record on rank 0, None elsewhere; a :class:`MedleyInputError` on every rank
        when the step diverged (a non-finite loss or gradient norm, or, ``exhausted``, fp16
        gradients that overflow at every loss scale; ``skipped_steps`` so far, for its line)."""
        step = gathered.pending.step
        loss = math.fsum(gathered.column("loss"))
        grad_norm = math.sqrt(math.fsum(gathered.column("grad_sq_norm")))
        skipped = bool(gathered.column("skipped_now")[0])
        if skipped:
            grad_norm = math.inf  # shares of an overflowed step are inf or NaN: say overflowed
        # A skipped fp16 step is no divergence unless no scale helps.
        if not math.isfinite(loss) or not (math.isfinite(grad_norm) or skipped) or exhausted:
            scale = gathered.column("loss_scale")[0]
            raise self.diverged(step, loss, grad_norm, exhausted=exhausted, loss_scale=scale,
                                skipped_steps=skipped_steps)
        agreed = list(zip(gathered.column("loss_scale"), gathered.column("skipped_steps"), strict=True))
        if len(set(agreed)) > 1:
            raise RuntimeError(f"step {step}: the ranks disagree on the loss scale or the skipped steps "
                               f"{agreed}: a bug in medley's fp16 loss scaling")
        if self.rank != 0:
            return None
        seconds = gathered.column("seconds")
        step_time = max(seconds)
        memory = {}
        if self.on_cuda and self.config.logging.measure_memory:
            memory = self.by_device([int(peak) for peak in gathered.column("peak_bytes")])
        eval_loss = None
        if self.config.eval_due(step):
            eval_loss = math.fsum(gathered.column("eval_loss")) / self.config.logging.eval_batches
        spans = gathered.spans
        return StepRecord(
            eval_loss=eval_loss, step_time_by_device=self.by_device(seconds),
            action_time_by_device=self.by_device(gathered.actions(ACTION_CATEGORIES)),
            action_spans_by_device=self.by_device([s for _, s in spans]) if spans else {},
            step_start_by_device=self.by_device([origin for origin, _ in spans]) if spans else {},
            step=step, loss=loss, lr=gathered.pending.lr, grad_norm=grad_norm,
            step_time_s=step_time, tokens_per_s=self.plan.tokens_per_step / step_time,
            learned_tokens_per_s=gathered.pending.learned_tokens / step_time,
            mfu=None if self.flops_per_peak is None else self.flops_per_peak / step_time,
            peak_memory_bytes=memory, emulated_sleep_s=max(gathered.column("slept")),
            loss_scale=gathered.column("loss_scale")[0] if self.fp16 else None,
            skipped_steps=int(gathered.column("skipped_steps")[0]),
            samples=self.source.sample_indices(step=step, seed=self.config.data.seed,
                                               sequences=self.sequences))

    def by_device(self, values: list) -> dict:
        """One value per global rank, keyed by the rank's plan device (ascending)."""
        return dict(sorted(((self.device_of_rank[r], value) for r, value in enumerate(values)),
                           key=lambda item: item[0]))

    def diverged(self, step: int, loss: float, grad_norm: float, *, exhausted: bool, loss_scale: float,
                 skipped_steps: int) -> MedleyInputError:
        """The line of a diverged run (before any checkpoint of its state)."""
        config = self.config
        kept = (f"; the checkpoints in {config.checkpoint.dir} are from before it"
                if config.checkpoint.dir is not None else "")
        if exhausted and math.isfinite(loss):
            return MedleyInputError(
                f"step {step}: fp16 gradients overflow even at loss scale {loss_scale:g} "
                f"({skipped_steps} steps skipped): training diverged, so the run stops{kept}; "
                f"lower --lr (now {config.optimizer.lr:g}) or train in bf16 or fp32 (--dtype) and rerun")
        return MedleyInputError(
            f"step {step}: loss {loss:g}, gradient norm {grad_norm:g}: training diverged, so the run stops "
            f"before saving this state{kept}; lower --lr (now {config.optimizer.lr:g}) and rerun")
