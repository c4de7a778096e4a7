"""How to train a plan: :class:`TrainConfig` (its sections and their flags are
:mod:`medley.runtime.settings`), checked by :func:`check_config` before any work, and
:class:`TrainHooks` for tests and tools (what rank 0 reports per step is
:class:`medley.runtime.records.StepRecord`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from medley.data.load import DataOptions, load_source
from medley.data.source import DataSource
from medley.errors import MedleyInputError
from medley.fileio import UnsafePathError, check_output_dir, check_output_file, open_no_follow
from medley.runtime.device_check import DEVICE_CHOICES
from medley.runtime.optim import OPTIMIZERS, SCHEDULES
from medley.runtime.records import StepRecord
from medley.runtime.settings import (
    CheckpointConfig,
    DataConfig,
    ElasticConfig,
    EmulationConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainConfig,
)
from medley.runtime.sharding import TORCH_DTYPES, ShardedStage
from medley.spec.limits import MAX_SEED, MAX_STEPS

__all__ = ["CheckpointConfig", "DataConfig", "ElasticConfig", "EmulationConfig", "LoggingConfig",
           "ModelConfig", "OptimizerConfig", "PrecisionConfig", "TrainConfig", "TrainHooks", "check_config",
           "load_data"]
GradHook = Callable[[int, dict[int, ShardedStage], float | None], None]


@dataclass(kw_only=True)
class TrainHooks:
    """Callbacks for tests and tools, apart from the settings (:func:`medley.runtime.train.train`).

    Attributes:
        on_step: called on every rank with the step index after each step (and its checkpoint).
        grad_hook: a test hook: called on every rank with (step, this rank's stages, the step's
            loss scale or None) right before the step's global gradient check (the CLIP action:
            clipping on, or fp16), after the gradient reductions; tests inject overflows and watch
            every rank with it. Must be picklable (a module-level function or a partial of one).
        on_record: called on rank 0 with each step's record, before ``on_step``.
        on_computed: called on every rank with the step index once the step's compute is done,
            before its checkpoint (the elastic heartbeat: a node lost during a save knows the
            step was done).
    """

    on_step: Callable[[int], None] | None = None
    grad_hook: GradHook | None = None
    on_record: Callable[[StepRecord], None] | None = None
    on_computed: Callable[[int], None] | None = None


def load_data(config: TrainConfig, *, seq_len: int, vocab_size: int, verify: bool = True) -> DataSource:
    """The run's data source; ``verify`` (the launching process) checks token ids and builds
    the token cache, the ranks (``verify=False``) only map it."""
    return load_source(config.data.path, seq_len=seq_len, options=data_options(config),
                       vocab_size=vocab_size, val_data=config.data.val_data, verify=verify)


def with_epochs(config: TrainConfig, source: DataSource, *, sequences: int) -> tuple[TrainConfig, str | None]:
    """With ``--epochs E``: a copy of ``config`` whose ``optimizer.steps`` are those of E passes
    over the training samples (:meth:`DataSource.samples_per_epoch`) at ``sequences`` per step,
    and the line that says so; without it, ``config`` as it is and None. Every process that reads
    the data computes the same."""
    epochs = config.optimizer.epochs
    if epochs is None:
        return config, None
    per_epoch = source.samples_per_epoch(config.data.seed)
    if per_epoch is None:
        raise MedleyInputError(f"--epochs: {source.name} is sampled at random offsets, without epochs; give "
                               "--steps, or a tokenized data set")
    count, what = per_epoch
    steps = max(1, math.ceil(epochs * count / sequences))
    if steps > MAX_STEPS:
        raise MedleyInputError(f"--epochs {epochs}: {steps:,} steps, more than {MAX_STEPS:,}; give fewer "
                               "epochs")
    line = f"--epochs {epochs:g}: {steps:,} steps of {sequences} sequences over {count:,} {what} per epoch"
    return dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, steps=steps)), line


def data_options(config: TrainConfig) -> DataOptions:
    """How to read the data: text is tokenized with ``tokenizer``, else with the model directory's
    ``tokenizer.json`` (``hf_dir``, else ``init_from``) when it has one, else read as bytes."""
    data = config.data
    tokenizer, model_dir = data.tokenizer, config.model.hf_dir or config.model.init_from
    if tokenizer is None and model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        tokenizer = str(model_dir)
    return DataOptions(tokenizer=tokenizer, text_field=data.text_field, token_dtype=data.token_dtype,
                       cache_dir=data.data_cache, val_fraction=data.val_fraction, kind=data.data_format,
                       chat_template=data.chat_template, pack=data.pack, seed=data.seed)


def _check_number(flag: str, value: float | None, *, positive: bool) -> None:
    """A finite number, > 0 (``positive``) or >= 0."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise MedleyInputError(
            f"{flag} {value}: must be a finite number {'> 0' if positive else '>= 0'}; e.g. {flag} "
            f"{'3e-3' if flag == '--lr' else '1'}")


def check_config(config: TrainConfig) -> None:
    """Refuse bad settings with one line naming the flag (before any work)."""
    opt, log, ckpt = config.optimizer, config.logging, config.checkpoint
    if not 1 <= opt.steps <= MAX_STEPS:
        raise MedleyInputError(f"--steps {opt.steps}: train 1..{MAX_STEPS:,} steps")
    if opt.epochs is not None and not (math.isfinite(opt.epochs) and opt.epochs > 0):
        raise MedleyInputError(f"--epochs {opt.epochs}: must be a number > 0; e.g. --epochs 3")
    if not 0 <= config.data.seed <= MAX_SEED:
        raise MedleyInputError(f"--seed {config.data.seed}: use a seed in 0..{MAX_SEED:,}")
    if opt.name not in OPTIMIZERS:
        raise MedleyInputError(f"--optimizer '{opt.name}' must be adamw or sgd")
    if opt.lr_schedule not in SCHEDULES:
        raise MedleyInputError(f"--lr-schedule '{opt.lr_schedule}' must be one of {', '.join(SCHEDULES)}")
    if not 0.0 < opt.decay_fraction <= 1.0:
        raise MedleyInputError(f"--decay-fraction {opt.decay_fraction}: give a share of the steps in (0, 1]")
    for flag, value, positive in (("--lr", opt.lr, False), ("--min-lr", opt.min_lr, False),
                                  ("--weight-decay", opt.weight_decay, False),
                                  ("--clip-norm", opt.clip_norm, True),
                                  ("--step-timeout", log.step_timeout_s, True),
                                  ("--first-step-timeout", log.first_step_timeout_s, True),
                                  ("--checkpoint-timeout", log.checkpoint_timeout_s, True)):
        _check_number(flag, value, positive=positive)
    if not 0 <= opt.warmup_steps <= MAX_STEPS:
        raise MedleyInputError(f"--warmup-steps {opt.warmup_steps} must be in 0..{MAX_STEPS:,}")
    if ckpt.dir is not None:
        check_output_dir(ckpt.dir, flag="--checkpoint-dir")
    if log.log_jsonl is not None:
        check_output_file(log.log_jsonl, flag="--log-jsonl")
        _check_appendable(Path(log.log_jsonl), flag="--log-jsonl")
    _check_eval(config)
    if ckpt.every < 0:
        raise MedleyInputError(f"--checkpoint-every {ckpt.every} must be >= 0")
    if ckpt.keep < 1:
        raise MedleyInputError(f"--keep {ckpt.keep}: keep at least 1 checkpoint")
    if not 1 <= log.log_every <= MAX_STEPS:
        raise MedleyInputError(f"--log-every {log.log_every}: gather and log every 1..{MAX_STEPS:,} steps")
    if log.gc_every < 0:
        raise MedleyInputError(f"--gc-every {log.gc_every} must be >= 0 (0: automatic collection)")
    if config.emulation.device not in DEVICE_CHOICES:
        raise MedleyInputError(f"--device '{config.emulation.device}' must be auto (the plan's devices) or "
                               "cpu")
    if config.precision.dtype not in (None, *TORCH_DTYPES):
        raise MedleyInputError(f"--dtype '{config.precision.dtype}' must be fp32, bf16 or fp16")
    _check_loss_scale(config.precision)
    _check_elastic(config)


def _check_elastic(config: TrainConfig) -> None:
    elastic = config.elastic
    if config.emulation.slowdown_from < 0:
        raise MedleyInputError(f"--slowdown-from {config.emulation.slowdown_from} must be >= 0")
    if elastic.straggler_margin <= 0 or not math.isfinite(elastic.straggler_margin):
        raise MedleyInputError(f"--straggler-margin {elastic.straggler_margin:g} must be > 0 (0.5: 50% "
                               "slower than the median device)")
    if elastic.straggler_steps < 0:
        raise MedleyInputError(f"--straggler-steps {elastic.straggler_steps} must be >= 0 (0: not watched)")
    if elastic.elastic and (config.checkpoint.dir is None or config.checkpoint.every < 1):
        raise MedleyInputError("--elastic needs --checkpoint-dir DIR on a file system every node shares "
                               "and --checkpoint-every N (a lost node's work is redone from the newest "
                               "checkpoint)")


def _check_appendable(path: Path, *, flag: str) -> None:
    """An existing ``path`` that is appended to in place is a regular file of its own: not a link
    (it would be written through), a FIFO or a file with other hard links."""
    if not os.path.lexists(path):
        return
    try:
        os.close(open_no_follow(path, os.O_WRONLY | os.O_APPEND))
    except UnsafePathError as err:
        raise MedleyInputError(f"{flag} {path}: {err.strerror}; give the path of a regular file") from None
    except OSError as err:
        raise MedleyInputError(f"{flag} {path}: cannot write ({err.strerror}); check the path and its "
                               "permissions") from None


def _check_eval(config: TrainConfig) -> None:
    """Evaluation settings, and TensorBoard installed when asked for."""
    log, data = config.logging, config.data
    if log.eval_every < 0 or log.eval_batches < 1:
        raise MedleyInputError(f"--eval-every {log.eval_every} must be >= 0 and --eval-batches "
                               f"{log.eval_batches} >= 1")
    if not 0 <= data.val_fraction < 1:
        raise MedleyInputError(f"--val-fraction {data.val_fraction} must be in [0, 1); e.g. 0.05")
    if log.eval_every and data.val_data is None and not data.val_fraction:
        raise MedleyInputError(f"--eval-every {log.eval_every}: nothing to evaluate on; give --val-data FILE "
                               "or --val-fraction F")
    if log.tensorboard is not None:
        check_output_dir(log.tensorboard, flag="--tensorboard")
        if importlib.util.find_spec("tensorboard") is None:
            raise MedleyInputError(f"--tensorboard {log.tensorboard}: the tensorboard package is not "
                                   "installed; pip install medley[tensorboard]")


def _check_loss_scale(precision: PrecisionConfig) -> None:
    """The fp16 loss-scale policy: a positive finite start, backoff in (0, 1), growth >= 1."""
    init, backoff = precision.loss_scale_init, precision.loss_scale_backoff
    growth = precision.loss_scale_growth
    if not (math.isfinite(init) and init > 0):
        raise MedleyInputError(f"TrainConfig.precision.loss_scale_init {init} must be a finite number > 0; "
                               "e.g. 65536")
    if not 0 < backoff < 1:
        raise MedleyInputError(f"TrainConfig.precision.loss_scale_backoff {backoff} must be in (0, 1); "
                               "e.g. 0.5")
    if not (math.isfinite(growth) and growth >= 1):
        raise MedleyInputError(f"TrainConfig.precision.loss_scale_growth {growth} must be a finite number "
                               ">= 1; e.g. 2")
    if precision.loss_scale_growth_interval < 1:
        raise MedleyInputError(
            f"TrainConfig.precision.loss_scale_growth_interval {precision.loss_scale_growth_interval} must "
            "be >= 1")
