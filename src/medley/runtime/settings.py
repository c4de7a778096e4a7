"""The settings of a run, each defined once: :class:`TrainConfig`'s sections, whose fields carry
their flags (:func:`medley.flags.setting`): ``medley train``'s options, the job file's keys and
docs/job-file.md are made from them (medley.cli.options). Without torch, so the CLI reads them
before it imports torch; the checks are :func:`medley.runtime.config.check_config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from medley.errors import MedleyInputError
from medley.flags import flag_name, flag_of, setting
from medley.runtime.checkpoint_layout import KEEP
from medley.spec.limits import MAX_SEED, MAX_STEPS


def parse_slowdown(text: str | None) -> dict[int, float]:
    """``"0=2,3=1.5"`` as {device id: factor}."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        device, _, factor = item.partition("=")
        try:
            out[int(device)] = float(factor)
        except ValueError:
            raise MedleyInputError(
                f"--slowdown '{text}' must look like '0=2.0,3=1.5' (device id=factor)") from None
    return out


@dataclass(kw_only=True)
class ModelConfig:
    """What the model starts from and how its blocks run ([model] of a job file).

    Attributes:
        init_from: a Hugging Face model directory whose safetensors weights the model starts from
            (each rank reads its own stages' tensors); None: the seeded initialisation.
        hf_dir: the Hugging Face model directory the model came from (``--model DIR`` or
            ``init_from``), recorded in checkpoints so that an export copies its tokenizer files.
        compile: ``torch.compile`` each transformer block (:mod:`medley.runtime.torch_compile`); the
            first step then includes the compilation.
    """

    init_from: Path | None = setting(None, "Start from this Hugging Face model directory's safetensors "
                                     "weights", path=True)
    hf_dir: Path | None = None
    compile: bool = setting(False, "torch.compile each transformer block (the first step includes compiling)")


@dataclass(kw_only=True)
class DataConfig:
    """What is trained on and in which order ([data]).

    Attributes:
        path: a data set (``.jsonl``, ``.parquet`` or a directory of them, a ``datasets``
            ``save_to_disk`` directory, a ``.bin`` token file, a text file), None for the shipped
            corpus, or ``"synthetic"`` (:mod:`medley.data.load`).
        tokenizer: a tokenizers ``tokenizer.json`` (or its directory) for text data; None: plain
            text is read as bytes.
        text_field: the JSON field or column holding the text.
        data_format: ``auto``, ``text``, ``chat`` (``messages`` rendered by the chat template, the
            loss on the assistant's tokens) or ``completion`` (``prompt``/``completion`` pairs, the
            loss on the completion); auto tells them by the first row's fields
            (:mod:`medley.data.examples`).
        chat_template: a Jinja chat template file for ``chat`` data; None: the tokenizer
            directory's (:mod:`medley.data.chat`).
        token_dtype: ids of ``.bin`` token files: ``uint16`` or ``uint32`` (None: the Megatron
            ``.idx`` beside it, else uint16 as nanoGPT).
        data_cache: where tokenized text is cached (None: ``~/.cache/medley/tokens``).
        val_data: a validation data set (same formats), all of its windows used in order.
        val_fraction: hold out this share of ``data``'s windows (the last ones) for validation.
        pack: pack several chat or prompt/completion examples into each sequence, attention and
            positions reset per example (:mod:`medley.data.packing`); text data fills its
            sequences already.
        seed: seed of the model initialisation and of the data order.
        reset_data_order: resume from a checkpoint written with another seed, global batch or
            data source (each difference is printed); without it such a resume is refused.
    """

    path: str | None = setting(None, "Data: .jsonl, .parquet (file or directory), datasets save_to_disk "
                               "directory, .bin token file, text file, or 'synthetic' (default: shipped "
                               "corpus)", name="data", path=True)
    tokenizer: str | None = setting(None, "tokenizer.json (or its directory) for text data (default: the "
                                    "model directory's, else a text file is read as bytes)", path=True)
    text_field: str = setting("text", "JSON field / column holding the text")
    data_format: str = setting("auto", "auto (by the first row's fields), text, chat ('messages' in the chat "
                               "template, loss on the assistant's tokens) or completion "
                               "('prompt'/'completion', loss on the completion)")
    chat_template: str | None = setting(None, "Jinja chat template file for chat data (default: the "
                                        "tokenizer directory's)", path=True)
    token_dtype: str | None = setting(None, ".bin token ids: uint16 or uint32 (default: from the .idx beside "
                                      "it, else uint16)")
    data_cache: Path | None = setting(None, "Token cache directory (default: ~/.cache/medley/tokens)",
                                      path=True)
    val_data: str | None = setting(None, "Validation data (same formats as --data)", path=True)
    val_fraction: float = setting(0.0, "Hold out this share of --data")
    pack: bool = setting(False, "Pack several chat/completion examples into each sequence (attention and "
                         "positions reset per example)")
    seed: int = setting(0, "Seed of weights and data order", minimum=0, maximum=MAX_SEED)
    reset_data_order: bool = setting(False, "Resume although the seed, global batch or --data differ from "
                                     "the checkpoint's")


@dataclass(kw_only=True)
class OptimizerConfig:
    """How many steps, and the update ([optimizer]).

    Attributes:
        steps: steps in total, skipped fp16 steps included (a resumed run continues up to this step).
        epochs: passes over the training data instead of ``steps``: ``steps`` becomes
            ``ceil(epochs * samples per epoch / sequences per step)`` once the data is read
            (:func:`medley.runtime.config.with_epochs`); None: ``steps`` as given.
        name: ``adamw`` or ``sgd``.
        lr: peak learning rate, reached after ``warmup_steps`` linear warm-up steps, then the
            schedule's decay to ``min_lr`` at step ``steps``; 0 updates nothing (min_lr is capped
            at lr).
        lr_schedule: the decay after warm-up (:class:`medley.runtime.optim.LrSchedule`):
            ``cosine``, ``linear``, ``constant`` (none) or ``wsd`` (warm-up, stable, decay: ``lr``
            until the last ``decay_fraction`` of the steps after warm-up, then linear to ``min_lr``).
        decay_fraction: ``wsd``'s share of the steps after warm-up that decays.
        extend_schedule: a resume follows the checkpoint's schedule (its steps, lr, min_lr,
            warm-up, kind), recorded at the run's start, and refuses a run whose schedule differs;
            with this, it follows this run's from the resumed step on (a longer run's curve).
        warmup_steps: linear warm-up steps.
        min_lr: learning rate at the end of the decay.
        weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
        clip_norm: clip gradients to this global L2 norm (across stages and shards); None: off.
    """

    steps: int = setting(20, "Optimizer steps in total", minimum=1, maximum=MAX_STEPS)
    epochs: float | None = setting(None, "Passes over the training examples or windows (sets --steps from "
                                   "the data)")
    name: str = setting("adamw", "adamw or sgd", name="optimizer")
    lr: float = setting(3e-3, "Peak learning rate (0: no updates)")
    warmup_steps: int = setting(5, "Linear warm-up steps", minimum=0, maximum=MAX_STEPS)
    min_lr: float = setting(3e-4, "Learning rate at the end of the decay")
    lr_schedule: str = setting("cosine", "Decay after warm-up: cosine, linear, constant or wsd (stable at "
                               "--lr, then linear over the last --decay-fraction)")
    decay_fraction: float = setting(0.2, "wsd: the share of the steps after warm-up that decays")
    extend_schedule: bool = setting(False, "Resume with this run's schedule (--steps, --lr, ...) although "
                                    "the checkpoint's differs; without it a resume follows the checkpoint's")
    weight_decay: float = setting(0.1, "Weight decay")
    clip_norm: float | None = setting(1.0, "Global gradient-norm clip (0: off)", off=True)


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

    dtype: str | None = setting(None, "fp32, bf16 or fp16 (default: the plan's on CUDA, fp32 on CPU)")
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

    dir: Path | None = setting(None, "Save here; resume from the newest", name="checkpoint_dir", path=True)
    every: int = setting(0, "Save every K steps (0: at the end)", name="checkpoint_every")
    keep: int = setting(KEEP, "Newest checkpoints kept, older ones deleted")
    async_save: bool = setting(False, "Write checkpoints in the background while training goes on (DCP async "
                               "save); each is published when the next starts, the last one at once",
                               name="async_checkpoint")


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

    log_jsonl: Path | None = setting(None, "Append one JSON line per step here", path=True)
    tensorboard: Path | None = setting(None, "Write TensorBoard scalars here", path=True)
    eval_every: int = setting(0, "Validation loss every N steps (0: off)")
    eval_batches: int = setting(2, "Validation batches per evaluation")
    progress: bool = False
    measure_memory: bool = True
    trace_actions: bool = False
    step_timeout_s: float | None = setting(600.0, "Seconds until a stuck step fails (0: off)", off=True,
                                           name="step_timeout")
    first_step_timeout_s: float | None = setting(1800.0, "Seconds until a stuck first step (compiling, "
                                                 "allocating) fails (0: off)", off=True,
                                                 name="first_step_timeout")
    checkpoint_timeout_s: float | None = setting(1800.0, "Seconds until a stuck checkpoint save fails "
                                                 "(0: off)", off=True, name="checkpoint_timeout")
    log_every: int = setting(10, "Gather the statistics and log a line every N steps (no host sync on the "
                             "steps between)")
    gc_every: int = setting(50, "Python garbage collection between steps every N steps, off inside steps "
                            "(0: automatic)")


@dataclass(kw_only=True)
class EmulationConfig:
    """Emulated device speeds on CPU ([plan] of a job file: they follow the plan's devices).

    Attributes:
        emulate: stretch each rank's compute by its device's slowdown (see
            ``medley.runtime.emulated_devices``).
        slowdown: factor per device id, overriding the plan-derived one (implies ``emulate``).
        slowdown_from: the step from which ``slowdown`` applies (before it, the plan-derived
            factors): a device that becomes slow mid-run.
        device: ``auto``: compute on the plan's devices (CUDA for GPU types, refused before any
            rank starts where there is none: :mod:`medley.runtime.device_check`); ``cpu``: run any
            plan on this machine's CPU (gloo), on purpose.
    """

    emulate: bool = setting(False, "Stretch compute per the plan's device speeds", section="plan")
    slowdown: dict[int, float] = setting(help="Emulated slowdown by device: 0=2,3=1.5", factory=dict,
                                         parse=parse_slowdown, section="plan")
    slowdown_from: int = setting(0, "The --slowdown factors apply from this step on (a device that slows "
                                 "down mid-run)", minimum=0, section="plan")
    device: str = setting("auto", "auto: compute on the plan's devices (a GPU plan where CUDA has no such "
                          "GPU is refused); cpu: run any plan on this CPU (gloo), on purpose", section="plan")


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

    elastic: bool = setting(False, "A rank of an elastic run: re-plan for the devices present (medley launch "
                            "--elastic sets it)")
    straggler_margin: float = setting(0.5, "Elastic: a device computing this share slower than planned, "
                                      "relative to the median device, is a straggler")
    straggler_steps: int = setting(3, "Elastic: ... for this many steps in a row: re-planned at its measured "
                                   "speed at the next checkpoint (0: off)", minimum=0)
    admit_wait_s: float = 60.0


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
        ``data``, ``checkpoint_dir``, ``dtype``, ...; or as their fields), each put in its section,
        values as the fields hold them (``clip_norm=None``, not the flag's 0): how the CLI and the
        tests build one. An unknown name is a TypeError, as for a dataclass."""
        parts: dict[str, dict[str, object]] = {name: {} for name in _SECTION_CLASSES}
        for name, value in settings.items():
            section, key = FLAGS.get(name) or (_SECTION_OF.get(name), name)
            if section is None:
                raise TypeError(f"TrainConfig.of() got an unexpected setting {name!r}")
            parts[section][key] = value
        return cls(**{name: _SECTION_CLASSES[name](**values) for name, values in parts.items()})

    def eval_due(self, step: int) -> bool:
        """Whether the model after ``step`` is evaluated: every ``eval_every`` steps and after the last."""
        every = self.logging.eval_every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.optimizer.steps)


_SECTION_CLASSES: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
                                     "precision": PrecisionConfig, "checkpoint": CheckpointConfig,
                                     "logging": LoggingConfig, "emulation": EmulationConfig,
                                     "elastic": ElasticConfig}
_SECTION_OF = {f.name: name for name, kind in _SECTION_CLASSES.items() for f in dataclasses.fields(kind)}
# Flag name (``checkpoint_dir``) -> (section, field): every setting ``medley train`` takes as a flag.
FLAGS: dict[str, tuple[str, str]] = {
    flag_name(f): (name, f.name)
    for name, kind in _SECTION_CLASSES.items() for f in dataclasses.fields(kind) if flag_of(f) is not None
}


