"""Train a plan for real: the step loop around :class:`~medley.runtime.executor.RankExecutor`.

Run :func:`train` on every rank of an initialised process group of ``pp x dp`` ranks (global
rank ``replica * pp + pipeline rank``), or :func:`medley.runtime.launch.train_local` to start the
ranks on this machine. Each step: the global batch of the step (the same sequences whatever the
plan), this replica's slice of it, the rank's program of the plan's schedule, then per-step
statistics gathered on rank 0.

Gradient clipping needs the global norm before any optimizer step. With ``clip_norm`` set, the
schedules are built with ``clip_grad`` (``medley.schedule.zero``): each rank's program ends with
one ``CLIP`` action, an all-reduce of its share of the squared norm (one fp64 scalar) over the
world group followed by the clip, and then its OPTIM actions. That all-reduce is a barrier across
all ranks at the end of every step: no optimizer step overlaps another rank's backward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from medley.cost import formulas
from medley.errors import MedleyInputError
from medley.fileio import check_output_dir, check_output_file
from medley.plan.plan import Plan
from medley.runtime import checkpoint, lock
from medley.runtime.data import load_source, replica_slice
from medley.runtime.emulate import slowdown_factors
from medley.runtime.executor import MicroBatches
from medley.runtime.lifecycle import StepWatchdog
from medley.runtime.memory import cuda_peak_bytes, probe_peak_bytes, reset_cuda_peak
from medley.runtime.optim import local_optimizer, lr_at, optimizer_class, set_lr
from medley.runtime.progress import TrainProgress
from medley.runtime.setup import RankSetup, build_rank

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class TrainConfig:
    """How to train a plan.

    Attributes:
        steps: optimizer steps in total (a resumed run continues up to this step).
        seed: seed of the model initialisation and of the data order.
        optimizer: ``adamw`` or ``sgd``.
        lr: peak learning rate, reached after ``warmup_steps`` linear warm-up steps, then cosine
            decay to ``min_lr`` at step ``steps``.
        warmup_steps: linear warm-up steps.
        min_lr: learning rate at the end of the cosine decay.
        weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
        clip_norm: clip gradients to this global L2 norm (across stages and shards); None: off.
        data: a UTF-8 text file, None for the shipped corpus, or ``"synthetic"``.
        checkpoint_dir: where checkpoints go; a run resumes from the newest one found there.
        checkpoint_every: save every this many steps (and after the last step); 0: only at the end.
        log_jsonl: rank 0 appends one JSON line per step here.
        emulate: stretch each rank's compute by its device's slowdown (see ``medley.runtime.emulate``).
        slowdown: factor per device id, overriding the plan-derived one (implies ``emulate``).
        progress: show a progress bar on rank 0.
        measure_memory: peak memory per rank: CUDA's counter every step; on CPU one untimed probe
            step after the last one, reported in every record.
        dtype: ``fp32`` or ``bf16`` (bf16 compute, fp32 master weights and gradient reductions);
            None: fp32 on CPU; on CUDA bf16 for a bf16 plan, else fp32 (no fp16 loss scaling).
        on_step: called on every rank with the step index after each step (and its checkpoint).
        step_timeout_s: a rank that spends longer than this in one step exits with one line (and
            every thread's stack under ``--debug``), so a hang (a mismatched collective never times
            out on gloo) fails the run (and, under restarts, resumes it) instead of stalling it;
            None: no watchdog.
        reset_data_order: resume from a checkpoint written with another seed, global batch or
            data source (each difference is printed); without it such a resume is refused.
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
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    log_jsonl: Path | None = None
    emulate: bool = False
    slowdown: dict[int, float] = field(default_factory=dict)
    progress: bool = False
    measure_memory: bool = True
    dtype: str | None = None
    on_step: Callable[[int], None] | None = None
    step_timeout_s: float | None = 600.0
    reset_data_order: bool = False


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
    if config.steps < 1:
        raise MedleyInputError(f"--steps {config.steps}: train at least one step")
    if config.optimizer not in ("adamw", "sgd"):
        raise MedleyInputError(f"--optimizer '{config.optimizer}' must be adamw or sgd")
    for flag, value, positive in (("--lr", config.lr, True), ("--min-lr", config.min_lr, False),
                                  ("--weight-decay", config.weight_decay, False),
                                  ("--clip-norm", config.clip_norm, True),
                                  ("--step-timeout", config.step_timeout_s, True)):
        _check_number(flag, value, positive=positive)
    if config.warmup_steps < 0:
        raise MedleyInputError(f"--warmup-steps {config.warmup_steps} must be >= 0")
    if config.checkpoint_dir is not None:
        check_output_dir(config.checkpoint_dir, flag="--checkpoint-dir")
    if config.log_jsonl is not None:
        check_output_file(config.log_jsonl, flag="--log-jsonl")
    if config.checkpoint_every < 0:
        raise MedleyInputError(f"--checkpoint-every {config.checkpoint_every} must be >= 0")
    if config.dtype not in (None, *DTYPES):
        raise MedleyInputError(f"--dtype '{config.dtype}' must be fp32 or bf16")


def train(plan: Plan, config: TrainConfig) -> list[StepRecord]:
    """Train ``plan`` on this rank; rank 0 returns the records of the steps it ran."""
    check_config(config)
    opt_class, opt_kwargs = optimizer_class(config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    dtype = resolve_dtype(plan, config)
    setup = build_rank(plan, seed=config.seed, optimizer_class=opt_class, optimizer_kwargs=opt_kwargs,
                       autocast_dtype=DTYPES[dtype], clip_grad=config.clip_norm
                       is not None, slowdown=_slowdown(plan, config))
    return _Loop(plan, config, setup).run()


def resolve_dtype(plan: Plan, config: TrainConfig) -> str:
    """The precision this process group trains ``plan`` in (see :func:`run_dtype`)."""
    return run_dtype(plan, config, on_cuda=dist.get_backend() == "nccl")


def run_dtype(plan: Plan, config: TrainConfig, *, on_cuda: bool) -> str:
    """fp32 on CPU unless asked; on CUDA the plan's bf16, or fp32 for an fp16 plan (fp16 would
    need loss scaling, which the runtime does not do)."""
    if config.dtype is not None:
        return config.dtype
    return "bf16" if on_cuda and plan.layout.dtype == "bf16" else "fp32"


def _slowdown(plan: Plan, config: TrainConfig) -> dict[int, float] | None:
    if not (config.emulate or config.slowdown):
        return None
    return slowdown_factors(plan, config.slowdown)


class _Loop:
    """One rank's training run: steps, statistics, checkpoints."""

    def __init__(self, plan: Plan, config: TrainConfig, setup: RankSetup) -> None:
        self.plan, self.config, self.setup = plan, config, setup
        layout = plan.layout
        self.source = load_source(config.data, seq_len=layout.seq_len)
        self.sequences = sum(layout.micro_batches) * layout.micro_batch_size
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sq_norm = torch.zeros((), dtype=torch.float64)
        if config.clip_norm is None:
            setup.executor.before_optim = self._count_norm
        else:
            setup.executor.on_clip = lambda: self._clip(config.clip_norm)
        self.meta = {"model": dataclasses.asdict(layout.model), "data": self.source.fingerprint,
                     "optimizer": config.optimizer, "seq_len": layout.seq_len, "seed": config.seed,
                     "global_batch": self.sequences,
                     "plan": {"pp": layout.pp, "dp": layout.dp, "split": list(layout.stage_layers),
                              "zero": [z.level for z in layout.zero]}}
        flops = formulas.megatron_flops_per_step(layout.model, batch_size=self.sequences,
                                                 seq_len=layout.seq_len)
        devices = [plan.cluster.devices[d].type for row in layout.assignment for d in row]
        peak = sum(t.peak_flops(resolve_dtype(plan, config)) for t in devices)
        self.flops_per_peak = flops / peak if setup.device.type == "cuda" and peak > 0 else None

    def _count_norm(self, stage: int, bucket: int | None) -> None:
        self.sq_norm += self.setup.stages[stage].grad_sq_norm(bucket, replica=self.setup.replica)

    def run(self) -> list[StepRecord]:
        held = self._lock()
        try:
            return self._run()
        finally:
            if held is not None:
                held.release()

    def _lock(self) -> lock.DirectoryLock | None:
        """Collective: rank 0 locks the checkpoint directory for this run, or every rank fails."""
        if self.config.checkpoint_dir is None:
            return None
        held, error = None, None
        if self.rank == 0:
            try:
                held = lock.acquire(self.config.checkpoint_dir)
            except MedleyInputError as err:
                error = str(err)
        error = checkpoint.shared_error(error)
        if error is not None:
            raise MedleyInputError(error)
        return held

    def _run(self) -> list[StepRecord]:
        start = self._resume()
        records: list[StepRecord] = []
        shown = self.config.progress and self.rank == 0
        progress = TrainProgress(self.config.steps, start) if shown else None
        timeout = self.config.step_timeout_s
        watchdog = StepWatchdog(timeout, rank=self.rank) if timeout is not None else None
        dist.barrier()
        try:
            for step in range(start, self.config.steps):
                if watchdog is not None:
                    watchdog.arm(step)
                local = self._step(step)
                record = self._record(step, local)
                if watchdog is not None:
                    watchdog.disarm()
                if record is not None:
                    records.append(record)
                    self._log(record)
                    if progress is not None:
                        progress.update(record)
                self._maybe_save(step + 1)
                if self.config.on_step is not None:
                    self.config.on_step(step)
        finally:
            if watchdog is not None:
                watchdog.close()
            if progress is not None:
                progress.close()
        if self.config.measure_memory and self.setup.device.type == "cpu" and start < self.config.steps:
            self._probe_memory(records)
        return records

    def _resume(self) -> int:
        latest = checkpoint.latest_checkpoint(self.config.checkpoint_dir)
        if latest is None:
            return 0
        start, changed = checkpoint.load_checkpoint(latest, stages=self.setup.stages, expected=self.meta,
                                                    reset_data_order=self.config.reset_data_order)
        if changed and self.rank == 0:
            print(f"resuming {latest} with a new data order (--reset-data-order): {'; '.join(changed)}",
                  file=sys.stderr, flush=True)
        return start

    def _maybe_save(self, next_step: int) -> None:
        every, directory = self.config.checkpoint_every, self.config.checkpoint_dir
        if directory is None:
            return
        if next_step == self.config.steps or (every > 0 and next_step % every == 0):
            checkpoint.save_checkpoint(directory, next_step=next_step, stages=self.setup.stages,
                                       meta=self.meta)

    def _batch(self, step: int) -> MicroBatches:
        layout = self.plan.layout
        tokens = self.source.global_batch(step=step, seed=self.config.seed, sequences=self.sequences,
                                          seq_len=layout.seq_len).to(self.setup.device)
        return replica_slice(tokens, micro_batches=layout.micro_batches,
                             micro_batch_size=layout.micro_batch_size, replica=self.setup.replica)

    def _step(self, step: int) -> torch.Tensor:
        """Run one step; this rank's [loss sum, squared grad norm share, seconds, slept, peak bytes]."""
        config, setup = self.config, self.setup
        lr = lr_at(step, lr=config.lr, min_lr=config.min_lr, warmup_steps=config.warmup_steps,
                   total_steps=config.steps)
        for stage in setup.stages.values():
            for optimizer in stage.optimizers:
                set_lr(optimizer, lr)
        batch = self._batch(step)
        self.sq_norm.zero_()
        setup.executor.emulated_sleep_s = 0.0
        reset_cuda_peak(setup.device)
        started = time.perf_counter()
        losses = setup.executor.run_step(batch)
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        elapsed = time.perf_counter() - started
        peak = cuda_peak_bytes(setup.device) if setup.device.type == "cuda" else 0
        loss_sum = float(sum(loss.item() for loss in losses))
        return torch.tensor([loss_sum, float(self.sq_norm), elapsed, setup.executor.emulated_sleep_s, peak],
                            dtype=torch.float64)

    def _clip(self, clip_norm: float) -> None:
        """Global norm by one all-reduce over the world; scale every gradient like torch's
        ``clip_grad_norm_`` (by ``clip / (norm + 1e-6)``, capped at 1)."""
        stages, replica = self.setup.stages, self.setup.replica
        local = sum((s.grad_sq_norm(None, replica=replica) for s in stages.values()),
                    torch.zeros((), dtype=torch.float64))
        total = local.reshape(1).to(self.setup.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        self.sq_norm = local  # reported through the statistics gather, summed there
        coef = min(1.0, clip_norm / (math.sqrt(float(total)) + 1e-6))
        for stage in stages.values():
            stage.scale_grads(coef)

    def _record(self, step: int, local: torch.Tensor) -> StepRecord | None:
        gathered = torch.zeros(self.world * local.numel(), dtype=torch.float64, device=self.setup.device)
        dist.all_gather_single(gathered, local.to(self.setup.device))
        stats = gathered.cpu().view(self.world, local.numel())
        loss, grad_norm = float(stats[:, 0].sum()), math.sqrt(float(stats[:, 1].sum()))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees it: all stop
            raise self._diverged(step, loss, grad_norm)
        if self.rank != 0:
            return None
        layout = self.plan.layout
        step_time = float(stats[:, 2].max())
        memory = {}
        if self.setup.device.type == "cuda" and self.config.measure_memory:
            memory = {self.setup.device_of_rank[r]: int(stats[r, 4]) for r in range(self.world)}
            memory = dict(sorted(memory.items()))
        lr = lr_at(step, lr=self.config.lr, min_lr=self.config.min_lr,
                   warmup_steps=self.config.warmup_steps, total_steps=self.config.steps)
        return StepRecord(
            step=step, loss=loss, lr=lr, grad_norm=grad_norm,
            step_time_s=step_time, tokens_per_s=layout.tokens_per_step / step_time,
            mfu=None if self.flops_per_peak is None else self.flops_per_peak / step_time,
            peak_memory_bytes=memory, emulated_sleep_s=float(stats[:, 3].max()))

    def _diverged(self, step: int, loss: float, grad_norm: float) -> MedleyInputError:
        kept = (f"; the checkpoints in {self.config.checkpoint_dir} are from before it"
                if self.config.checkpoint_dir is not None else "")
        return MedleyInputError(
            f"step {step}: loss {loss:g}, gradient norm {grad_norm:g}: training diverged, so the run stops "
            f"before saving this state{kept}; lower --lr (now {self.config.lr:g}) and rerun")

    def _log(self, record: StepRecord) -> None:
        if self.config.log_jsonl is None:
            return
        path = Path(self.config.log_jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = dataclasses.asdict(record)
        line["peak_memory_bytes"] = {str(k): v for k, v in record.peak_memory_bytes.items()}
        with open(path, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def _resident_tensors(self) -> list[torch.Tensor]:
        """Tensors alive between steps: weights (and FSDP's gathered copies), gradients, reduced
        gradients and optimizer state."""
        out: list[torch.Tensor] = []
        for stage in self.setup.stages.values():
            params = [*stage.module.parameters(), *stage.weights()]
            out += params + [p.grad for p in params if p.grad is not None] + list(stage.reduced.values())
            out += list(stage.module.buffers())
            for optimizer in stage.optimizers:
                for state in local_optimizer(optimizer).state.values():
                    out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def _probe_memory(self, records: list[StepRecord]) -> None:
        """One more step under the memory tracker (after the last checkpoint: it changes nothing
        that is kept); its peak per rank goes into every record."""
        setup = self.setup
        batch = self._batch(self.config.steps)

        def step() -> None:
            setup.executor.run_step(batch)

        peak = torch.tensor([probe_peak_bytes(step, existing=self._resident_tensors())], dtype=torch.float64)
        gathered = torch.zeros(self.world, dtype=torch.float64)
        dist.all_gather_single(gathered, peak)
        memory = dict(sorted((setup.device_of_rank[r], int(gathered[r])) for r in range(self.world)))
        for record in records:
            record.peak_memory_bytes = dict(memory)
        if self.rank == 0 and self.config.log_jsonl is not None:
            with open(self.config.log_jsonl, "a") as handle:
                handle.write(json.dumps({"memory_probe": {str(k): v for k, v in memory.items()}}) + "\n")
