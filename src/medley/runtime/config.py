"""How to train a plan (:class:`TrainConfig`, checked by :func:`check_config` before any work) and
what rank 0 reports per step (:class:`StepRecord`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from medley.errors import MedleyInputError
from medley.fileio import UnsafePathError, check_output_dir, check_output_file, open_no_follow
from medley.runtime.checkpoint import KEEP
from medley.runtime.data import DataOptions, DataSource, load_source
from medley.runtime.sharding import TORCH_DTYPES, ShardedStage
from medley.spec.limits import MAX_SEED, MAX_STEPS

GradHook = Callable[[int, dict[int, ShardedStage], float | None], None]


@dataclass(kw_only=True)
class TrainConfig:
    """How to train a plan.

    Attributes:
        steps: steps in total, skipped fp16 steps included (a resumed run continues up to this step).
        seed: seed of the model initialisation and of the data order.
        optimizer: ``adamw`` or ``sgd``.
        lr: peak learning rate, reached after ``warmup_steps`` linear warm-up steps, then cosine
            decay to ``min_lr`` at step ``steps``; 0 updates nothing (min_lr is capped at lr).
        warmup_steps: linear warm-up steps.
        min_lr: learning rate at the end of the cosine decay.
        weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
        clip_norm: clip gradients to this global L2 norm (across stages and shards); None: off.
        data: a data set (``.jsonl``, ``.parquet`` or a directory of them, a ``datasets``
            ``save_to_disk`` directory, a ``.bin`` token file, a text file), None for the shipped
            corpus, or ``"synthetic"`` (:mod:`medley.runtime.data`).
        tokenizer: a tokenizers ``tokenizer.json`` (or its directory) for text data; None: plain
            text is read as bytes.
        text_field: the JSON field or column holding the text.
        data_format: ``auto``, ``text``, ``chat`` (``messages`` rendered by the chat template, the
            loss on the assistant's tokens) or ``completion`` (``prompt``/``completion`` pairs, the
            loss on the completion); auto tells them by the first row's fields
            (:mod:`medley.runtime.data.examples`).
        chat_template: a Jinja chat template file for ``chat`` data; None: the tokenizer
            directory's (:mod:`medley.runtime.data.chat`).
        token_dtype: ids of ``.bin`` token files: ``uint16`` or ``uint32`` (None: the Megatron
            ``.idx`` beside it, else uint16 as nanoGPT).
        data_cache: where tokenized text is cached (None: ``~/.cache/medley/tokens``).
        val_data: a validation data set (same formats), all of its windows used in order.
        val_fraction: hold out this share of ``data``'s windows (the last ones) for validation.
        eval_every: every this many steps (and after the last), the mean loss over
            ``eval_batches`` fixed validation batches, forward only; 0: never.
        eval_batches: validation batches (each the shape of the global batch) per evaluation.
        tensorboard: rank 0 writes TensorBoard scalars here (needs the tensorboard package).
        checkpoint_dir: where checkpoints go; a run resumes from the newest one found there.
        checkpoint_every: save every this many steps (and after the last step); 0: only at the end.
        checkpoint_keep: the newest checkpoints kept (older ones are deleted after each save);
            ``checkpoint_dir`` must be one directory every node sees (checked at start).
        log_jsonl: rank 0 appends one JSON line per step here.
        emulate: stretch each rank's compute by its device's slowdown (see ``medley.runtime.emulate``).
        slowdown: factor per device id, overriding the plan-derived one (implies ``emulate``).
        progress: show a progress bar on rank 0.
        measure_memory: peak memory per rank: CUDA's counter every step; on CPU one untimed probe
            step after the last one, reported in every record.
        dtype: ``fp32``, ``bf16`` or ``fp16`` (half-precision compute under autocast on fp32
            master weights and optimizer; weights gathered and gradients reduced in the dtypes of
            ``medley.cost.zero_memory``; fp16 with dynamic loss scaling); None: the
            plan's precision on CUDA, fp32 on CPU. Rank 0 says so when it is not the plan's.
        loss_scale_init: fp16: the loss scale of the first step (torch GradScaler's 2**16).
        loss_scale_backoff: fp16: the scale is multiplied by this after a step whose gradients
            overflowed somewhere in the world (that step is skipped on every rank).
        loss_scale_growth: fp16: the scale is multiplied by this after
            ``loss_scale_growth_interval`` steps in a row without overflow.
        loss_scale_growth_interval: see ``loss_scale_growth``.
        on_step: called on every rank with the step index after each step (and its checkpoint).
        step_timeout_s: a rank that spends longer than this in one step exits with one line (and
            every thread's stack under ``--debug``), so a hang (a mismatched collective never times
            out on gloo) fails the run (and, under restarts, resumes it) instead of stalling it;
            None: no watchdog.
        gc_every: Python's cyclic garbage collector is off during training and runs between
            steps every this many steps, on every rank (torchtitan's ``gc_freq``), so that no
            collection pauses one rank mid-step while the others wait; 0: automatic collection.
        reset_data_order: resume from a checkpoint written with another seed, global batch or
            data source (each difference is printed); without it such a resume is refused.
        grad_hook: a test hook: called on every rank with (step, this rank's stages, the step's
            loss scale or None) right before the step's global gradient check (the CLIP action:
            clipping on, or fp16), after the gradient reductions; tests inject overflows and watch
            every rank with it. Must be picklable (a module-level function or a partial of one).
        init_from: a Hugging Face model directory whose safetensors weights the model starts from
            (each rank reads its own stages' tensors); None: the seeded initialisation.
        hf_dir: the Hugging Face model directory the model came from (``--model DIR`` or
            ``init_from``), recorded in checkpoints so that an export copies its tokenizer files.
        compile: ``torch.compile`` each transformer block (:mod:`medley.runtime.compile`); the
            first step then includes the compilation.
        trace_actions: every record carries each rank's per-action timings of its step
            (``StepRecord.action_spans_by_device``; one more gather per step, outside its timed part).
    """

    steps: int = 20
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 3e-3
    warmup_steps: int = 5
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    data: str | None = None
    tokenizer: str | None = None
    text_field: str = "text"
    data_format: str = "auto"
    chat_template: str | None = None
    token_dtype: str | None = None
    data_cache: Path | None = None
    val_data: str | None = None
    val_fraction: float = 0.0
    eval_every: int = 0
    eval_batches: int = 2
    tensorboard: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = KEEP
    log_jsonl: Path | None = None
    emulate: bool = False
    slowdown: dict[int, float] = field(default_factory=dict)
    progress: bool = False
    measure_memory: bool = True
    dtype: str | None = None
    on_step: Callable[[int], None] | None = None
    step_timeout_s: float | None = 600.0
    gc_every: int = 50
    reset_data_order: bool = False
    loss_scale_init: float = 2.0**16
    loss_scale_backoff: float = 0.5
    loss_scale_growth: float = 2.0
    loss_scale_growth_interval: int = 2000
    grad_hook: GradHook | None = None
    init_from: Path | None = None
    hf_dir: Path | None = None
    compile: bool = False
    trace_actions: bool = False

    def data_options(self) -> DataOptions:
        """How to read the data: text is tokenized with ``tokenizer``, else with the model
        directory's ``tokenizer.json`` (``hf_dir``, else ``init_from``) when it has one, else read
        as bytes."""
        tokenizer, model_dir = self.tokenizer, self.hf_dir or self.init_from
        if tokenizer is None and model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            tokenizer = str(model_dir)
        return DataOptions(tokenizer=tokenizer, text_field=self.text_field, token_dtype=self.token_dtype,
                           cache_dir=self.data_cache, val_fraction=self.val_fraction, kind=self.data_format,
                           chat_template=self.chat_template)

    def eval_due(self, step: int) -> bool:
        """Whether the model after ``step`` is evaluated: every ``eval_every`` steps and after the last."""
        return self.eval_every > 0 and ((step + 1) % self.eval_every == 0 or step + 1 == self.steps)


def load_data(config: TrainConfig, *, seq_len: int, vocab_size: int, verify: bool = True) -> DataSource:
    """The run's data source; ``verify`` (the launching process) checks token ids and builds
    the token cache, the ranks (``verify=False``) only map it."""
    return load_source(config.data, seq_len=seq_len, options=config.data_options(), vocab_size=vocab_size,
                       val_data=config.val_data, verify=verify)


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
        action_spans_by_device: with ``TrainConfig.trace_actions``, by device id, each action of
            the rank's program in order as (action in medley's text form, start s, end s), times
            since the rank's step began (``RankExecutor.action_spans``); else empty.
        step_start_by_device: with ``trace_actions``, by device id, when the rank's step began on
            ``time.perf_counter``'s clock (one clock for the processes of one machine on Linux).
    """

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    peak_memory_bytes: dict[int, int] = field(default_factory=dict)
    emulated_sleep_s: float = 0.0
    loss_scale: float | None = None
    skipped_steps: int = 0
    eval_loss: float | None = None
    step_time_by_device: dict[int, float] = field(default_factory=dict)
    action_time_by_device: dict[int, dict[str, float]] = field(default_factory=dict)
    action_spans_by_device: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)
    step_start_by_device: dict[int, float] = field(default_factory=dict)

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
    if not 1 <= config.steps <= MAX_STEPS:
        raise MedleyInputError(f"--steps {config.steps}: train 1..{MAX_STEPS:,} steps")
    if not 0 <= config.seed <= MAX_SEED:
        raise MedleyInputError(f"--seed {config.seed}: use a seed in 0..{MAX_SEED:,}")
    if config.optimizer not in ("adamw", "sgd"):
        raise MedleyInputError(f"--optimizer '{config.optimizer}' must be adamw or sgd")
    for flag, value, positive in (("--lr", config.lr, False), ("--min-lr", config.min_lr, False),
                                  ("--weight-decay", config.weight_decay, False),
                                  ("--clip-norm", config.clip_norm, True),
                                  ("--step-timeout", config.step_timeout_s, True)):
        _check_number(flag, value, positive=positive)
    if not 0 <= config.warmup_steps <= MAX_STEPS:
        raise MedleyInputError(f"--warmup-steps {config.warmup_steps} must be in 0..{MAX_STEPS:,}")
    if config.checkpoint_dir is not None:
        check_output_dir(config.checkpoint_dir, flag="--checkpoint-dir")
    if config.log_jsonl is not None:
        check_output_file(config.log_jsonl, flag="--log-jsonl")
        _check_appendable(Path(config.log_jsonl), flag="--log-jsonl")
    _check_eval(config)
    if config.checkpoint_every < 0:
        raise MedleyInputError(f"--checkpoint-every {config.checkpoint_every} must be >= 0")
    if config.checkpoint_keep < 1:
        raise MedleyInputError(f"--keep {config.checkpoint_keep}: keep at least 1 checkpoint")
    if config.gc_every < 0:
        raise MedleyInputError(f"--gc-every {config.gc_every} must be >= 0 (0: automatic collection)")
    if config.dtype not in (None, *TORCH_DTYPES):
        raise MedleyInputError(f"--dtype '{config.dtype}' must be fp32, bf16 or fp16")
    _check_loss_scale(config)


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
    if config.eval_every < 0 or config.eval_batches < 1:
        raise MedleyInputError(f"--eval-every {config.eval_every} must be >= 0 and --eval-batches "
                               f"{config.eval_batches} >= 1")
    if not 0 <= config.val_fraction < 1:
        raise MedleyInputError(f"--val-fraction {config.val_fraction} must be in [0, 1); e.g. 0.05")
    if config.eval_every and config.val_data is None and not config.val_fraction:
        raise MedleyInputError(f"--eval-every {config.eval_every}: nothing to evaluate on; give "
                               "--val-data FILE "
                               "or --val-fraction F")
    if config.tensorboard is not None:
        check_output_dir(config.tensorboard, flag="--tensorboard")
        if importlib.util.find_spec("tensorboard") is None:
            raise MedleyInputError(f"--tensorboard {config.tensorboard}: the tensorboard package is not "
                                   "installed; pip install medley[tensorboard]")


def _check_loss_scale(config: TrainConfig) -> None:
    """The fp16 loss-scale policy: a positive finite start, backoff in (0, 1), growth >= 1."""
    init, backoff, growth = config.loss_scale_init, config.loss_scale_backoff, config.loss_scale_growth
    if not (math.isfinite(init) and init > 0):
        raise MedleyInputError(f"TrainConfig.loss_scale_init {init} must be a finite number > 0; e.g. 65536")
    if not 0 < backoff < 1:
        raise MedleyInputError(f"TrainConfig.loss_scale_backoff {backoff} must be in (0, 1); e.g. 0.5")
    if not (math.isfinite(growth) and growth >= 1):
        raise MedleyInputError(f"TrainConfig.loss_scale_growth {growth} must be a finite number >= 1; e.g. 2")
    if config.loss_scale_growth_interval < 1:
        raise MedleyInputError(
            f"TrainConfig.loss_scale_growth_interval {config.loss_scale_growth_interval} must be >= 1")
