"""How to train a plan: :class:`TrainConfig` in the sections of a job file, checked by
:func:`check_config` before any work, and :class:`TrainHooks` for tests and tools (what rank 0
reports per step is :class:`medley.runtime.records.StepRecord`)."""

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
from medley.runtime.device_check import DEVICE_CHOICES
from medley.runtime.records import StepRecord
from medley.runtime.sharding import TORCH_DTYPES, ShardedStage
from medley.spec.limits import MAX_SEED, MAX_STEPS

GradHook = Callable[[int, dict[int, ShardedStage], float | None], None]


@dataclass(kw_only=True)
class ModelConfig:
    """What the model starts from and how its blocks run ([model] of a job file).

    Attributes:
        init_from: a Hugging Face model directory whose safetensors weights the model starts from
            (each rank reads its own stages' tensors); None: the seeded initialisation.
        hf_dir: the Hugging Face model directory the model came from (``--model DIR`` or
            ``init_from``), recorded in checkpoints so that an export copies its tokenizer files.
        compile: ``torch.compile`` each transformer block (:mod:`medley.runtime.compile`); the
            first step then includes the compilation.
    """

    init_from: Path | None = None
    hf_dir: Path | None = None
    compile: bool = False


@dataclass(kw_only=True)
class DataConfig:
    """What is trained on and in which order ([data]).

    Attributes:
        path: a data set (``.jsonl``, ``.parquet`` or a directory of them, a ``datasets``
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
        seed: seed of the model initialisation and of the data order.
        reset_data_order: resume from a checkpoint written with another seed, global batch or
            data source (each difference is printed); without it such a resume is refused.
    """

    path: str | None = None
    tokenizer: str | None = None
    text_field: str = "text"
    data_format: str = "auto"
    chat_template: str | None = None
    token_dtype: str | None = None
    data_cache: Path | None = None
    val_data: str | None = None
    val_fraction: float = 0.0
    seed: int = 0
    reset_data_order: bool = False


@dataclass(kw_only=True)
class OptimizerConfig:
    """How many steps, and the update ([optimizer]).

    Attributes:
        steps: steps in total, skipped fp16 steps included (a resumed run continues up to this step).
        name: ``adamw`` or ``sgd``.
        lr: peak learning rate, reached after ``warmup_steps`` linear warm-up steps, then cosine
            decay to ``min_lr`` at step ``steps``; 0 updates nothing (min_lr is capped at lr).
        warmup_steps: linear warm-up steps.
        min_lr: learning rate at the end of the cosine decay.
        weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
        clip_norm: clip gradients to this global L2 norm (across stages and shards); None: off.
    """

    steps: int = 20
    name: str = "adamw"
    lr: float = 3e-3
    warmup_steps: int = 5
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0


@dataclass(kw_only=True)
class PrecisionConfig:
    """The compute precision and fp16's loss scaling ([precision]).

    Attributes:
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
    """

    dtype: str | None = None
    loss_scale_init: float = 2.0**16
    loss_scale_backoff: float = 0.5
    loss_scale_growth: float = 2.0
    loss_scale_growth_interval: int = 2000


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often the run saves, and how many it keeps ([checkpoint]).

    Attributes:
        dir: where checkpoints go; a run resumes from the newest one found there.
        every: save every this many steps (and after the last step); 0: only at the end.
        keep: the newest checkpoints kept (older ones are deleted after each save);
            ``checkpoint_dir`` must be one directory every node sees (checked at start).
        async_save: write each checkpoint but the last in the background (DCP's async save)
            while training goes on; it is published when the next one starts.
    """

    dir: Path | None = None
    every: int = 0
    keep: int = KEEP
    async_save: bool = False


@dataclass(kw_only=True)
class LoggingConfig:
    """What the run reports, evaluates and watches ([logging]).

    Attributes:
        log_jsonl: rank 0 appends one JSON line per step here.
        tensorboard: rank 0 writes TensorBoard scalars here (needs the tensorboard package).
        eval_every: every this many steps (and after the last), the mean loss over
            ``eval_batches`` fixed validation batches, forward only; 0: never.
        eval_batches: validation batches (each the shape of the global batch) per evaluation.
        progress: show progress on rank 0: a bar on a terminal, else a line every ``log_every``
            steps (under nohup or a batch system, where stderr is a file).
        log_every: the ranks gather their statistics (losses, gradient norm, times) every this
            many steps, and after the first step, the last and every checkpoint: a host sync
            there, none on the other steps (their statistics wait on the device). Every step still
            gets its record (``log_jsonl``, TensorBoard), written at those steps; a diverged run
            stops at the next of them, before any checkpoint of the diverged state.
        measure_memory: peak memory per rank: CUDA's counter every step; on CPU one untimed probe
            step after the last one, reported in every record.
        trace_actions: every record carries each rank's per-action timings of its step
            (``StepRecord.action_spans_by_device``; one more gather per step, outside its timed part).
        step_timeout_s: a rank that spends longer than this in one step exits with one line (and
            every thread's stack under ``--debug``), so a hang (a mismatched collective never times
            out on gloo) fails the run (and, under restarts, resumes it) instead of stalling it;
            None: no watchdog. The first step and checkpoint saves have their own limits; the
            process group's timeout is longer than all three
            (:func:`medley.runtime.lifecycle.process_group_timeout_s`), so the watchdog names a hang.
        first_step_timeout_s: the same for the first step of a run (compiling, allocating, the
            first collectives' connections); None: not watched.
        checkpoint_timeout_s: the same for each checkpoint save; None: not watched.
        gc_every: Python's cyclic garbage collector is off during training and runs between
            steps every this many steps, on every rank (torchtitan's ``gc_freq``), so that no
            collection pauses one rank mid-step while the others wait; 0: automatic collection.
    """

    log_jsonl: Path | None = None
    tensorboard: Path | None = None
    eval_every: int = 0
    eval_batches: int = 2
    progress: bool = False
    measure_memory: bool = True
    trace_actions: bool = False
    step_timeout_s: float | None = 600.0
    first_step_timeout_s: float | None = 1800.0
    checkpoint_timeout_s: float | None = 1800.0
    log_every: int = 10
    gc_every: int = 50


@dataclass(kw_only=True)
class EmulationConfig:
    """Emulated device speeds on CPU ([plan] of a job file: they follow the plan's devices).

    Attributes:
        emulate: stretch each rank's compute by its device's slowdown (see ``medley.runtime.emulate``).
        slowdown: factor per device id, overriding the plan-derived one (implies ``emulate``).
        slowdown_from: the step from which ``slowdown`` applies (before it, the plan-derived
            factors): a device that becomes slow mid-run.
        device: ``auto``: compute on the plan's devices (CUDA for GPU types, refused before any
            rank starts where there is none: :mod:`medley.runtime.device_check`); ``cpu``: run any
            plan on this machine's CPU (gloo), on purpose.
    """

    emulate: bool = False
    slowdown: dict[int, float] = field(default_factory=dict)
    slowdown_from: int = 0
    device: str = "auto"


@dataclass(kw_only=True)
class ElasticConfig:
    """An elastic run's own settings ([elastic] of a job file; ``medley launch --elastic`` sets
    ``elastic``, :mod:`medley.elastic`).

    Attributes:
        elastic: this rank is one of an elastic run: it re-plans for the devices present.
        straggler_margin: a device is a straggler when its compute time per step, relative to
            the plan's prediction for it, exceeds the median device's by more than this share.
        straggler_steps: for this many steps in a row (then it is re-planned at its measured
            speed at the next checkpoint); 0: stragglers are not watched.
        admit_wait_s: how long the ranks wait at a checkpoint for a node that asked to join.
    """

    elastic: bool = False
    straggler_margin: float = 0.5
    straggler_steps: int = 3
    admit_wait_s: float = 60.0


# Flat names (as medley train's flags name the settings) that differ from their section's field.
_RENAMED = {"data": ("data", "path"), "optimizer": ("optimizer", "name"),
            "checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
            "checkpoint_keep": ("checkpoint", "keep")}


@dataclass(kw_only=True)
class TrainConfig:
    """How to train a plan, in the sections of a job file (docs/job-file.md; hooks for tests are
    :class:`TrainHooks`, apart).

    Attributes:
        model: :class:`ModelConfig`: Hugging Face weights, compilation.
        data: :class:`DataConfig`: the data, its tokenizer and format, validation, seed.
        optimizer: :class:`OptimizerConfig`: steps, optimizer, learning-rate schedule, clipping.
        precision: :class:`PrecisionConfig`: dtype and fp16's loss scaling.
        checkpoint: :class:`CheckpointConfig`: directory, interval, how many kept.
        logging: :class:`LoggingConfig`: log file, TensorBoard, evaluation, progress, memory,
            traces, the step watchdog and garbage collection.
        emulation: :class:`EmulationConfig`: emulated device speeds.
        elastic: :class:`ElasticConfig`: re-planning on lost, returning and slow devices.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    @classmethod
    def of(cls, **settings: object) -> TrainConfig:
        """A config from flat settings named as ``medley train``'s flags name them (``lr``,
        ``data``, ``checkpoint_dir``, ``dtype``, ...), each put in its section: how the CLI and
        the tests build one. An unknown name is a TypeError, as for a dataclass."""
        parts: dict[str, dict[str, object]] = {name: {} for name in _SECTION_CLASSES}
        for name, value in settings.items():
            section, key = _RENAMED.get(name) or (_SECTION_OF.get(name), name)
            if section is None:
                raise TypeError(f"TrainConfig.of() got an unexpected setting {name!r}")
            parts[section][key] = value
        return cls(**{name: _SECTION_CLASSES[name](**values) for name, values in parts.items()})

    def data_options(self) -> DataOptions:
        """How to read the data: text is tokenized with ``tokenizer``, else with the model
        directory's ``tokenizer.json`` (``hf_dir``, else ``init_from``) when it has one, else read
        as bytes."""
        data = self.data
        tokenizer, model_dir = data.tokenizer, self.model.hf_dir or self.model.init_from
        if tokenizer is None and model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            tokenizer = str(model_dir)
        return DataOptions(tokenizer=tokenizer, text_field=data.text_field, token_dtype=data.token_dtype,
                           cache_dir=data.data_cache, val_fraction=data.val_fraction, kind=data.data_format,
                           chat_template=data.chat_template)

    def eval_due(self, step: int) -> bool:
        """Whether the model after ``step`` is evaluated: every ``eval_every`` steps and after the last."""
        every = self.logging.eval_every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.optimizer.steps)


_SECTION_CLASSES: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
                                     "precision": PrecisionConfig, "checkpoint": CheckpointConfig,
                                     "logging": LoggingConfig, "emulation": EmulationConfig,
                                     "elastic": ElasticConfig}
_SECTION_OF = {f.name: name for name, kind in _SECTION_CLASSES.items() for f in dataclasses.fields(kind)}


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
    return load_source(config.data.path, seq_len=seq_len, options=config.data_options(),
                       vocab_size=vocab_size, val_data=config.data.val_data, verify=verify)


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
    if not 0 <= config.data.seed <= MAX_SEED:
        raise MedleyInputError(f"--seed {config.data.seed}: use a seed in 0..{MAX_SEED:,}")
    if opt.name not in ("adamw", "sgd"):
        raise MedleyInputError(f"--optimizer '{opt.name}' must be adamw or sgd")
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
