"""Single-process reference training: the whole model on the whole global batch, in one process.

Any plan trained with the same :class:`~medley.runtime.train.TrainConfig` must give these losses
(within fp32 round-off): same initial weights (seeded per layer), same batches (a function of
the step), same optimizer, learning-rate schedule and clipping; and the same validation losses
on the steps where ``eval_every`` is due.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from medley.data.source import DataSource
from medley.plan.layout import PlanLayout
from medley.runtime.config import with_epochs
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.lora import freeze_base
from medley.runtime.materialize import init_local_shards
from medley.runtime.optim import LrSchedule, optimizer_class, set_lr
from medley.runtime.train import TrainConfig, load_data
from medley.runtime.transformer import Decoder, token_loss_sum


@dataclass(kw_only=True)
class ReferenceRun:
    """Attributes:
    losses: mean token loss of each step's global batch.
    eval_losses: validation loss after each step where evaluation is due, by step.
    model: the whole model after the last step.
    """

    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    model: Decoder | None = None


def reference_losses(layout: PlanLayout, config: TrainConfig, *, steps: int | None = None) -> list[float]:
    """Mean token loss of each step's global batch, trained in this process (fp32)."""
    return reference_run(layout, config, steps=steps).losses


def reference_train(layout: PlanLayout, config: TrainConfig, *,
                    steps: int | None = None) -> tuple[Decoder, list[float]]:
    """The whole model after training in this process, and each step's loss."""
    run = reference_run(layout, config, steps=steps)
    assert run.model is not None
    return run.model, run.losses


def reference_run(layout: PlanLayout, config: TrainConfig, *, steps: int | None = None) -> ReferenceRun:
    """Train the whole model in this process (fp32) from the run's initial weights (seeded, or
    ``config.model.init_from``; a LoRA layout's adapters seeded, its base frozen): the losses, and
    the validation losses where due."""
    model = Decoder(layout.model, seed=config.data.seed, init=config.model.init_from is None,
                    adapter=layout.adapter)
    if config.model.init_from is not None:
        load_hf_weights(model, config.model.init_from)
        init_local_shards(model, config.data.seed, adapters_only=True)
    if layout.adapter is not None:
        freeze_base(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = config.optimizer
    opt_class, kwargs = optimizer_class(opt.name, lr=opt.lr, weight_decay=opt.weight_decay)
    optimizer = opt_class(trained, **kwargs)
    source = load_data(config, seq_len=layout.seq_len, vocab_size=layout.model.vocab_size)
    sequences = layout.sequences_per_step
    config, _ = with_epochs(config, source, sequences=sequences)
    opt = config.optimizer
    run = ReferenceRun()
    schedule = LrSchedule.of(opt)
    for step in range(opt.steps if steps is None else steps):
        set_lr(optimizer, schedule.at(step))
        rows = source.global_rows(step=step, seed=config.data.seed, sequences=sequences,
                                  seq_len=layout.seq_len)
        loss = token_loss_sum(model(rows.tokens[:, :-1], rows.segments), rows.targets) / rows.loss_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if opt.clip_norm is not None:
            grads = [p.grad for p in trained]
            norm = math.sqrt(float(sum(g.double().square().sum() for g in grads)))
            coef = min(1.0, opt.clip_norm / (norm + 1e-6))
            for grad in grads:
                grad.mul_(coef)
        optimizer.step()
        run.losses.append(loss.item())
        if config.eval_due(step):
            run.eval_losses[step] = _eval_loss(model, source, config.logging.eval_batches, sequences)
    run.model = model
    return run


def _eval_loss(model: Decoder, source: DataSource, batches: int, sequences: int) -> float:
    with torch.no_grad():
        total = 0.0
        for index in range(batches):
            rows = source.eval_rows(index, sequences=sequences)
            logits = model(rows.tokens[:, :-1], rows.segments)
            total += float(token_loss_sum(logits, rows.targets) / rows.loss_tokens)
    return total / batches
