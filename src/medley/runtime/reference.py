"""Single-process reference training: the whole model on the whole global batch, in one process.

Any plan trained with the same :class:`~medley.runtime.train.TrainConfig` must give these losses
(within fp32 round-off): same initial weights (seeded per layer), same batches (a function of
the step), same optimizer, learning-rate schedule and clipping.
"""

from __future__ import annotations

import math

from medley.plan.compile import PlanLayout
from medley.runtime.data import load_source
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.model import Decoder, token_loss_sum
from medley.runtime.optim import lr_at, optimizer_class, set_lr
from medley.runtime.train import TrainConfig


def reference_losses(layout: PlanLayout, config: TrainConfig, *, steps: int | None = None) -> list[float]:
    """Mean token loss of each step's global batch, trained in this process (fp32)."""
    return reference_train(layout, config, steps=steps)[1]


def reference_train(layout: PlanLayout, config: TrainConfig, *,
                    steps: int | None = None) -> tuple[Decoder, list[float]]:
    """The whole model trained in this process (fp32) from the run's initial weights (seeded, or
    ``config.init_from``), and the mean token loss of each step's global batch."""
    model = Decoder(layout.model, seed=config.seed, init=config.init_from is None)
    if config.init_from is not None:
        load_hf_weights(model, config.init_from)
    opt_class, kwargs = optimizer_class(config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    optimizer = opt_class(model.parameters(), **kwargs)
    source = load_source(config.data, seq_len=layout.seq_len)
    sequences = sum(layout.micro_batches) * layout.micro_batch_size
    losses = []
    for step in range(config.steps if steps is None else steps):
        set_lr(optimizer, lr_at(step, lr=config.lr, min_lr=config.min_lr, warmup_steps=config.warmup_steps,
                                total_steps=config.steps))
        tokens = source.global_batch(step=step, seed=config.seed, sequences=sequences, seq_len=layout.seq_len)
        loss = token_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.clip_norm is not None:
            grads = [p.grad for p in model.parameters()]
            norm = math.sqrt(float(sum(g.double().square().sum() for g in grads)))
            coef = min(1.0, config.clip_norm / (norm + 1e-6))
            for grad in grads:
                grad.mul_(coef)
        optimizer.step()
        losses.append(loss.item())
    return model, losses
