"""TensorBoard scalars of a training run (``--tensorboard DIR``), beside the JSONL log.

Rank 0 writes one point per step under ``train/`` (loss, lr, grad_norm, tokens_per_s, mfu,
loss_scale, step_time_s and ``step_time_s/device_<id>`` per plan device) and ``eval/loss`` on
evaluation steps, at the count of steps done (after step index 0: 1, as the progress lines and
the checkpoint names count); an elastic run adds its events under ``elastic/``, at the steps
done when they happened.
``torch.utils.tensorboard`` is imported only when asked for; the
``tensorboard`` package is an optional extra (``pip install medley[tensorboard]``).
"""

from __future__ import annotations

from pathlib import Path

from medley.runtime.records import StepRecord


class TensorBoardLog:
    """A ``SummaryWriter`` on ``directory``, fed :class:`StepRecord` s."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: StepRecord) -> None:
        step = record.step + 1  # steps done, as the progress lines and the checkpoints count them
        scalars = {"loss": record.loss, "lr": record.lr, "grad_norm": record.grad_norm,
                   "tokens_per_s": record.tokens_per_s, "learned_tokens_per_s": record.learned_tokens_per_s,
                   "step_time_s": record.step_time_s,
                   "mfu": record.mfu, "loss_scale": record.loss_scale}
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(f"train/{name}", value, step)
        for device, seconds in record.step_time_by_device.items():
            self.writer.add_scalar(f"train/step_time_s/device_{device}", seconds, step)
        if record.eval_loss is not None:
            self.writer.add_scalar("eval/loss", record.eval_loss, step)
        self.writer.flush()

    def write_event(self, step: int, line: str, *, recovery_s: float | None, steps_redone: int) -> None:
        """An elastic run's event (:mod:`medley.elastic`) at the first step after it: its line as
        text under ``elastic/event``, its recovery time and redone steps as scalars."""
        self.writer.add_text("elastic/event", line, step)
        if recovery_s is not None:
            self.writer.add_scalar("elastic/recovery_s", recovery_s, step)
        self.writer.add_scalar("elastic/steps_redone", steps_redone, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
