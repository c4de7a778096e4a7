"""What rank 0 reports for each step of a run (:class:`StepRecord`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class StepRecord:
    """What rank 0 reports for one step.

    Attributes:
        step: step index (0-based).
        loss: mean token loss of the global batch, before the update.
        lr: learning rate of the step.
        grad_norm: global gradient L2 norm before clipping.
        step_time_s: wall time of the step, max over ranks (statistics and checkpoints excluded).
        tokens_per_s: tokens of the global batch per second of ``step_time_s``.
        learned_tokens_per_s: of them, the targets the loss counts per second (all of them for
            text; for instruction data neither the prompts nor the padding).
        mfu: model FLOPs utilisation against the peaks of the plan's devices; None on CPU.
        peak_memory_bytes: measured peak memory per device id of the plan.
        emulated_sleep_s: most time any rank slept this step to emulate a slower device.
        loss_scale: fp16: the scale this step's backward used (None in other precisions).
        skipped_steps: fp16: steps skipped so far for non-finite gradients, this one included (a
            skipped step has an infinite ``grad_norm`` and changed nothing).
        eval_loss: mean token loss over the validation batches of the model after this step's
            update (steps where ``eval_every`` is due), else None.
        step_time_by_device: the step's wall time on each rank, by device id of the plan.
        action_time_by_device: of it, by device id, the seconds each rank spent in each kind of
            action (``medley.runtime.executor.ACTION_CATEGORIES``: compute, transfer, zero, optim,
            clip); host time, so on CUDA only the launches.
        action_spans_by_device: with ``TrainConfig.logging.trace_actions``, by device id, each action of
            the rank's program in order as (action in medley's text form, start s, end s), times
            since the rank's step began (``RankExecutor.action_spans``); else empty.
        step_start_by_device: with ``trace_actions``, by device id, when the rank's step began on
            ``time.perf_counter``'s clock (one clock for the processes of one machine on Linux).
        samples: the indices of the global batch's samples in the training data (its windows or
            examples, in batch order); empty for byte text and synthetic data, which have none.
    """

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    learned_tokens_per_s: float = 0.0
    peak_memory_bytes: dict[int, int] = field(default_factory=dict)
    emulated_sleep_s: float = 0.0
    loss_scale: float | None = None
    skipped_steps: int = 0
    eval_loss: float | None = None
    step_time_by_device: dict[int, float] = field(default_factory=dict)
    action_time_by_device: dict[int, dict[str, float]] = field(default_factory=dict)
    action_spans_by_device: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)
    step_start_by_device: dict[int, float] = field(default_factory=dict)
    samples: list[int] = field(default_factory=list)

    def as_json(self) -> dict:
        """The record as strict JSON: device ids as strings, a skipped step's infinite
        ``grad_norm`` as null."""
        row = dataclasses.asdict(self)
        row["peak_memory_bytes"] = {str(k): v for k, v in self.peak_memory_bytes.items()}
        row["step_time_by_device"] = {str(k): v for k, v in self.step_time_by_device.items()}
        row["action_time_by_device"] = {str(k): v for k, v in self.action_time_by_device.items()}
        row["action_spans_by_device"] = {str(k): v for k, v in self.action_spans_by_device.items()}
        row["step_start_by_device"] = {str(k): v for k, v in self.step_start_by_device.items()}
        if not math.isfinite(self.grad_norm):
            row["grad_norm"] = None
        return row
