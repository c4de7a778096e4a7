"""Train a plan for real: the step loop around :class:`~medley.runtime.executor.RankExecutor`.

Run :func:`train` on every rank of an initialised process group of ``pp x dp`` ranks (each rank
finds its plan device and so its replica and pipeline rank, :mod:`medley.runtime.placement`), or
:func:`medley.runtime.launch.train_local` to start the ranks on this machine. Each step: the
global batch of the step (the same sequences whatever the plan), this replica's slice of it, the
rank's program of the plan's schedule, then per-step statistics gathered on rank 0.

Gradient clipping needs the global norm before any optimizer step. With ``clip_norm`` set, the
schedules are built with ``clip_grad`` (``medley.schedule.zero``): each rank's program ends with
one ``CLIP`` action, an all-reduce of its share of the squared norm (one fp64 scalar) over the
world group followed by the clip, and then its OPTIM actions. That all-reduce is a barrier across
all ranks at the end of every step: no optimizer step overlaps another rank's backward.

fp16 runs scale the loss (:mod:`medley.runtime.precision`) and always carry the ``CLIP`` action:
its all-reduce is also the world-wide overflow check, so every rank skips the same steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from medley.cost import formulas
from medley.errors import MedleyInputError
from medley.fileio import append_text
from medley.plan.plan import Plan
from medley.runtime import checkpoint, lock
from medley.runtime.collector import StepGarbageCollector
from medley.runtime.config import TrainConfig, TrainHooks, check_config, load_data
from medley.runtime.data import replica_slice
from medley.runtime.emulate import slowdown_factors
from medley.runtime.executor import ACTION_CATEGORIES, MicroBatches
from medley.runtime.lifecycle import StepWatchdog
from medley.runtime.memory import cuda_peak_bytes, probe_peak_bytes, reset_cuda_peak, resident_tensors
from medley.runtime.metrics import TensorBoardLog
from medley.runtime.optim import lr_at, optimizer_class, set_lr
from medley.runtime.precision import LossScaler, choose_dtype, unscale_and_clip
from medley.runtime.progress import TrainProgress
from medley.runtime.records import StepRecord
from medley.runtime.setup import RankSetup, build_rank
from medley.spec.cluster_schema import printable

__all__ = ["StepRecord", "TrainConfig", "TrainHooks", "check_config", "load_data", "resolve_dtype",
           "run_dtype", "train"]


def train(plan: Plan, config: TrainConfig, hooks: TrainHooks | None = None) -> list[StepRecord]:
    """Train ``plan`` on this rank; rank 0 returns the records of the steps it ran."""
    check_config(config)
    opt = config.optimizer
    opt_class, opt_kwargs = optimizer_class(opt.name, lr=opt.lr, weight_decay=opt.weight_decay,
                                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dtype = resolve_dtype(plan, config)
    # fp16 checks its gradients in the CLIP action's all-reduce: its schedules always have one.
    clip_grad = opt.clip_norm is not None or dtype == "fp16"
    setup = build_rank(plan, seed=config.data.seed, optimizer_class=opt_class, optimizer_kwargs=opt_kwargs,
                       compile=config.model.compile,
                       dtype=dtype, clip_grad=clip_grad, slowdown=_slowdown(plan, config, late=False),
                       init_from=config.model.init_from)
    scaler = None
    if dtype == "fp16":
        precision = config.precision
        scaler = LossScaler(scale=precision.loss_scale_init, backoff=precision.loss_scale_backoff,
                            growth=precision.loss_scale_growth,
                            growth_interval=precision.loss_scale_growth_interval)
    return _Loop(plan, config, hooks or TrainHooks(), setup, scaler).run()


def resolve_dtype(plan: Plan, config: TrainConfig) -> str:
    """The precision this process group trains ``plan`` in (see :func:`run_dtype`)."""
    return run_dtype(plan, config, on_cuda=dist.get_backend() == "nccl")


def run_dtype(plan: Plan, config: TrainConfig, *, on_cuda: bool) -> str:
    """``config.precision.dtype`` when given, else the plan's on CUDA and fp32 on CPU
    (:func:`medley.runtime.precision.choose_dtype`)."""
    return choose_dtype(plan, config.precision.dtype, on_cuda=on_cuda)


def _slowdown(plan: Plan, config: TrainConfig, *, late: bool) -> dict[int, float] | None:
    """Emulated slowdown per plan device: from the start (``late`` False: the ``--slowdown``
    factors only when they apply from step 0) or from ``--slowdown-from`` on (``late``)."""
    emulation = config.emulation
    if not (emulation.emulate or emulation.slowdown):
        return None
    if late and not (emulation.slowdown and emulation.slowdown_from > 0):
        return None
    return slowdown_factors(plan, emulation.slowdown if late or emulation.slowdown_from == 0 else None)


class _Loop:
    """One rank's training run: steps, statistics, checkpoints."""

    def __init__(self, plan: Plan, config: TrainConfig, hooks: TrainHooks, setup: RankSetup,
                 scaler: LossScaler | None) -> None:
        self.plan, self.config, self.hooks, self.setup, self.scaler = plan, config, hooks, setup, scaler
        self.step_index, self.step_lr = 0, config.optimizer.lr
        self.skipped_steps = torch.zeros((), dtype=torch.int64)  # checkpointed, whatever the precision
        layout = plan.shared
        # The launching process checked the data and built any token cache: ranks map it.
        self.source = load_data(config, seq_len=layout.seq_len, vocab_size=layout.model.vocab_size,
                                verify=False)
        self.sequences = sum(plan.micro_batches) * layout.micro_batch_size
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sq_norm = torch.zeros((), dtype=torch.float64)
        late = _slowdown(plan, config, late=True)
        self.late_slowdown = None if late is None else late[setup.device_of_rank[self.rank]]
        self.step_spans: tuple[float, list[tuple[float, float]]] = (0.0, [])  # the last step's
        if not setup.executor.carries_clip:  # clipping off, not fp16, no tied copies
            setup.executor.before_optim = self._count_norm
        else:
            setup.executor.on_clip = self._clip
        self.meta = {"model": dataclasses.asdict(layout.model), "data": self.source.fingerprint,
                     "optimizer": config.optimizer.name, "seq_len": layout.seq_len, "seed": config.data.seed,
                     "global_batch": self.sequences,
                     "hf_dir": None if config.model.hf_dir is None
                     else str(Path(config.model.hf_dir).resolve()),
                     "plan": [{"pp": group.pp, "dp": group.dp, "split": list(group.stage_layers),
                               "zero": [z.level for z in group.zero],
                               "tp": [group.tp_of(k) for k in range(group.pp)]} for group in plan.groups]}
        if not plan.asymmetric:
            self.meta["plan"] = self.meta["plan"][0]
        flops = formulas.megatron_flops_per_step(layout.model, batch_size=self.sequences,
                                                 seq_len=layout.seq_len)
        devices = [plan.cluster.devices[d].type for d in plan.devices]
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
        if self.config.checkpoint.dir is None:
            return None
        held, error = None, None
        if self.rank == 0:
            try:
                held = lock.acquire(self.config.checkpoint.dir)
            except MedleyInputError as err:
                error = str(err)
        error = checkpoint.shared_error(error)
        if error is not None:
            raise MedleyInputError(error)
        try:
            checkpoint.check_shared(self.config.checkpoint.dir, None if held is None else held.token)
        except MedleyInputError:
            if held is not None:
                held.release()
            raise
        return held

    def _run(self) -> list[StepRecord]:
        start = self._resume()
        records: list[StepRecord] = []
        shown = self.config.logging.progress and self.rank == 0
        progress = TrainProgress(self.config.optimizer.steps, start) if shown else None
        board = None
        if self.rank == 0 and self.config.logging.tensorboard is not None:
            board = TensorBoardLog(self.config.logging.tensorboard)
        timeout = self.config.logging.step_timeout_s
        watchdog = StepWatchdog(timeout, rank=self.rank) if timeout is not None else None
        dist.barrier()
        collector = StepGarbageCollector(self.config.logging.gc_every)
        try:
            collector.start()
            for step in range(start, self.config.optimizer.steps):
                if watchdog is not None:
                    watchdog.arm(step)
                local = torch.cat([self._step(step), self._evaluate(step)])
                record = self._record(step, local)
                if watchdog is not None:
                    watchdog.disarm()
                if record is not None:
                    records.append(record)
                    if self.hooks.on_record is not None:
                        self.hooks.on_record(record)
                    self._log(record)
                    if board is not None:
                        board.write(record)
                    if progress is not None:
                        progress.update(record)
                self._maybe_save(step + 1)
                if self.hooks.on_step is not None:
                    self.hooks.on_step(step)
                collector.after_step(step)
        finally:
            checkpoint.drop_pending()  # a save still in flight after a failure is never published
            collector.stop()
            if watchdog is not None:
                watchdog.close()
            if progress is not None:
                progress.close()
            if board is not None:
                board.close()
        on_cpu = self.setup.device.type == "cpu"
        if self.config.logging.measure_memory and on_cpu and start < self.config.optimizer.steps:
            self._probe_memory(records)
        return records

    def _resume(self) -> int:
        latest = checkpoint.latest_checkpoint(self.config.checkpoint.dir)
        if latest is None:
            return 0
        state = self._train_state()
        start, changed = checkpoint.load_checkpoint(latest, stages=self.setup.stages, expected=self.meta,
                                                    reset_data_order=self.config.data.reset_data_order,
                                                    train_state=state)
        self.skipped_steps = state["skipped_steps"]
        if self.scaler is not None:
            self.scaler.load(state)
            self.scaler.skipped_steps = int(self.skipped_steps)
        if changed and self.rank == 0:
            print(printable(f"resuming {latest} with a new data order (--reset-data-order): "
                            f"{'; '.join(changed)}"), file=sys.stderr, flush=True)
        return start

    def _maybe_save(self, next_step: int) -> None:
        every, directory = self.config.checkpoint.every, self.config.checkpoint.dir
        if directory is None:
            return
        last = next_step == self.config.optimizer.steps
        if last or (every > 0 and next_step % every == 0):
            checkpoint.save_checkpoint(directory, next_step=next_step, stages=self.setup.stages,
                                       meta=self.meta, train_state=self._train_state(),
                                       keep=self.config.checkpoint.keep,
                                       asynchronous=self.config.checkpoint.async_save and not last)

    def _train_state(self) -> dict[str, torch.Tensor]:
        """The loop's checkpointed scalars: the skipped steps (they hold back the learning-rate
        schedule) and, in fp16, the loss scale."""
        state = {"skipped_steps": self.skipped_steps.clone()}
        return state if self.scaler is None else {**state, **self.scaler.state()}

    def _batch(self, step: int) -> MicroBatches:
        layout = self.plan.shared
        rows = self.source.global_rows(step=step, seed=self.config.data.seed, sequences=self.sequences,
                                       seq_len=layout.seq_len).to(self.setup.device)
        return replica_slice(rows, micro_batches=self.plan.micro_batches,
                             micro_batch_size=layout.micro_batch_size, replica=self.setup.replica)

    def _step(self, step: int) -> torch.Tensor:
        """Run one step; this rank's [loss sum, squared grad norm share, seconds, slept, peak bytes,
        loss scale used, skipped steps so far, seconds in each of ACTION_CATEGORIES]."""
        config, setup = self.config, self.setup
        # The schedule counts applied updates: a skipped fp16 step holds it back (as Megatron-LM).
        self.step_index, self.step_lr = step, lr_at(
            step - int(self.skipped_steps), lr=config.optimizer.lr, min_lr=config.optimizer.min_lr,
            warmup_steps=config.optimizer.warmup_steps, total_steps=config.optimizer.steps)
        for stage in setup.stages.values():
            for optimizer in stage.optimizers:
                set_lr(optimizer, self.step_lr)
        if self.scaler is not None:
            setup.executor.loss_scale = self.scaler.scale
        if self.late_slowdown is not None and step >= config.emulation.slowdown_from:
            setup.executor.slowdown = self.late_slowdown
        batch = self._batch(step)
        self.sq_norm.zero_()
        setup.executor.emulated_sleep_s = 0.0
        reset_cuda_peak(setup.device)
        started = time.perf_counter()
        losses = setup.executor.run_step(batch)
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        elapsed = time.perf_counter() - started
        # This step's action timings (an evaluation makes its own).
        self.step_spans = (setup.executor.action_origin, setup.executor.action_spans)
        peak = cuda_peak_bytes(setup.device) if setup.device.type == "cuda" else 0
        loss_sum = self._own(losses)
        return torch.tensor([loss_sum, float(self.sq_norm), elapsed, setup.executor.emulated_sleep_s, peak,
                             setup.executor.loss_scale, float(self.skipped_steps),
                             *(setup.executor.action_s[c] for c in ACTION_CATEGORIES)], dtype=torch.float64)

    def _evaluate(self, step: int) -> torch.Tensor:
        """This rank's share of the validation loss of the model after ``step`` (forward only,
        through the plan's pipeline), summed over the ``eval_batches`` batches; 0 when not due."""
        if not self.config.eval_due(step):
            return torch.zeros(1, dtype=torch.float64)
        layout, total = self.plan.shared, 0.0
        for index in range(self.config.logging.eval_batches):
            rows = self.source.eval_rows(index, sequences=self.sequences).to(self.setup.device)
            batch = replica_slice(rows, micro_batches=self.plan.micro_batches,
                                  micro_batch_size=layout.micro_batch_size, replica=self.setup.replica)
            total += self._own(self.setup.executor.run_forward(batch))
        return torch.tensor([total], dtype=torch.float64)

    def _own(self, losses: list[torch.Tensor]) -> float:
        """The losses this rank adds to the step's statistics: every TP rank of the last stage
        computes them alike, so TP rank 0 alone counts them."""
        return float(sum(loss.item() for loss in losses)) if self.setup.tp_rank == 0 else 0.0

    def _clip(self) -> None:
        """The CLIP action: global norm by one all-reduce over the world, unscaled and clipped like
        torch's ``clip_grad_norm_``; in fp16 a non-finite norm skips the step on every rank."""
        setup = self.setup
        if self.hooks.grad_hook is not None:
            self.hooks.grad_hook(self.step_index, setup.stages,
                                  None if self.scaler is None else self.scaler.scale)
        # This rank's share, reported through the statistics gather (summed there).
        self.sq_norm = unscale_and_clip(setup.stages, replica=setup.replica, device=setup.device,
                                        clip_norm=self.config.optimizer.clip_norm, scaler=self.scaler)
        if self.scaler is not None and self.scaler.skipped_now:
            setup.executor.skip_optim = True
            self.skipped_steps.fill_(self.scaler.skipped_steps)

    def _record(self, step: int, local: torch.Tensor) -> StepRecord | None:
        gathered = torch.zeros(self.world * local.numel(), dtype=torch.float64, device=self.setup.device)
        dist.all_gather_single(gathered, local.to(self.setup.device))
        stats = gathered.cpu().view(self.world, local.numel())
        loss, grad_norm = float(stats[:, 0].sum()), math.sqrt(float(stats[:, 1].sum()))
        skipped = self.scaler is not None and self.scaler.skipped_now
        if skipped:
            grad_norm = math.inf  # shares of an overflowed step are inf or NaN: say overflowed
        # Every rank sees the same: all stop. A skipped fp16 step is no divergence unless no scale helps.
        if not math.isfinite(loss) or not (math.isfinite(grad_norm) or skipped) or (
                self.scaler is not None and self.scaler.exhausted):
            raise self._diverged(step, loss, grad_norm)
        if not bool((stats[:, 5:7] == stats[0, 5:7]).all()):
            raise RuntimeError(f"step {step}: the ranks disagree on the loss scale or the skipped steps "
                               f"{stats[:, 5:7].tolist()}: a bug in medley's fp16 loss scaling")
        spans = self._gather_spans()
        if self.rank != 0:
            return None
        step_time = float(stats[:, 2].max())
        memory = {}
        if self.setup.device.type == "cuda" and self.config.logging.measure_memory:
            memory = {device: int(peak) for device, peak in self._by_device(stats[:, 4]).items()}
        eval_loss = None
        if self.config.eval_due(step):
            eval_loss = float(stats[:, 7 + len(ACTION_CATEGORIES)].sum()) / self.config.logging.eval_batches
        return StepRecord(
            eval_loss=eval_loss, step_time_by_device=self._by_device(stats[:, 2]),
            action_time_by_device=self._by_device(
                [dict(zip(ACTION_CATEGORIES, row, strict=True))
                 for row in stats[:, 7:7 + len(ACTION_CATEGORIES)].tolist()]),
            action_spans_by_device=self._by_device([s for _, s in spans]) if spans else {},
            step_start_by_device=self._by_device([origin for origin, _ in spans]) if spans else {},
            step=step, loss=loss,
            lr=self.step_lr, grad_norm=grad_norm,
            step_time_s=step_time, tokens_per_s=self.plan.tokens_per_step / step_time,
            mfu=None if self.flops_per_peak is None else self.flops_per_peak / step_time,
            peak_memory_bytes=memory, emulated_sleep_s=float(stats[:, 3].max()),
            loss_scale=None if self.scaler is None else float(stats[0, 5]), skipped_steps=int(stats[0, 6]),
            samples=self.source.sample_indices(step=step, seed=self.config.data.seed,
                                               sequences=self.sequences))

    def _gather_spans(self) -> list[tuple[float, list[tuple[str, float, float]]]]:
        """Collective with ``trace_actions``: every rank's (program start, [(action, start, end)])
        of its last step, by global rank; else nothing."""
        if not self.config.logging.trace_actions:
            return []
        origin, spans = self.step_spans
        mine = (origin, [(str(a), start, end) for a, (start, end) in
                         zip(self.setup.executor.program, spans, strict=True)])
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, mine)
        return gathered

    def _by_device(self, values: torch.Tensor | list) -> dict:
        """One value per global rank (a column of the stats, or a list), keyed by the rank's plan
        device (ascending)."""
        values = values.tolist() if isinstance(values, torch.Tensor) else values
        return dict(sorted(((self.setup.device_of_rank[r], values[r]) for r in range(self.world)),
                           key=lambda item: item[0]))

    def _diverged(self, step: int, loss: float, grad_norm: float) -> MedleyInputError:
        kept = (f"; the checkpoints in {self.config.checkpoint.dir} are from before it"
                if self.config.checkpoint.dir is not None else "")
        if self.scaler is not None and self.scaler.exhausted and math.isfinite(loss):
            return MedleyInputError(
                f"step {step}: fp16 gradients overflow even at loss scale {self.setup.executor.loss_scale:g} "
                f"({int(self.skipped_steps)} steps skipped): training diverged, so the run stops{kept}; "
                f"lower --lr (now {self.config.optimizer.lr:g}) or train in bf16 or fp32 (--dtype) and rerun")
        return MedleyInputError(
            f"step {step}: loss {loss:g}, gradient norm {grad_norm:g}: training diverged, so the run stops "
            f"before saving this state{kept}; lower --lr (now {self.config.optimizer.lr:g}) and rerun")

    def _log(self, record: StepRecord) -> None:
        if self.config.logging.log_jsonl is None:
            return
        path = Path(self.config.logging.log_jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        append_text(path, json.dumps(record.as_json(), allow_nan=False) + "\n")

    def _probe_memory(self, records: list[StepRecord]) -> None:
        """One more step under the memory tracker (after the last checkpoint: it changes nothing
        that is kept); its peak per rank goes into every record."""
        setup = self.setup
        self.step_index = self.config.optimizer.steps
        batch = self._batch(self.config.optimizer.steps)

        def step() -> None:
            setup.executor.run_step(batch)

        existing = resident_tensors(setup.stages.values())
        peak = torch.tensor([probe_peak_bytes(step, existing=existing)], dtype=torch.float64)
        gathered = torch.zeros(self.world, dtype=torch.float64)
        dist.all_gather_single(gathered, peak)
        memory = dict(sorted((setup.device_of_rank[r], int(gathered[r])) for r in range(self.world)))
        for record in records:
            record.peak_memory_bytes = dict(memory)
        if self.rank == 0 and self.config.logging.log_jsonl is not None:
            append_text(Path(self.config.logging.log_jsonl),
                    json.dumps({"memory_probe": {str(k): v for k, v in memory.items()}}) + "\n")
