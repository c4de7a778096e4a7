"""Train a plan for real: the step loop around :class:`~medley.runtime.executor.RankExecutor`.

Run :func:`train` on every rank of an initialised process group of ``pp x dp`` ranks (each rank
finds its plan device and so its replica and pipeline rank, :mod:`medley.runtime.placement`), or
:func:`medley.launch.spawn.train_local` to start the ranks on this machine. Each step: the
global batch of the step (the same sequences whatever the plan), this replica's slice of it, the
rank's program of the plan's schedule. The statistics of a step (losses, gradient norm, times)
stay on the device, and the ranks gather them every ``--log-every`` steps, at the first and last
step and at each checkpoint (:mod:`medley.runtime.step_stats`): no host sync per micro-batch, none
on the steps in between (fp16 waits once per step, for the skip decision); rank 0 then makes every
step's record. A diverged run stops at that gather, so before any checkpoint of its state.

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
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from medley.cost import formulas
from medley.data.source import MicroBatches, Rows, replica_slice
from medley.errors import MedleyInputError
from medley.fileio import append_text
from medley.plan.plan import Plan
from medley.runtime import checkpoint, checkpoint_layout, lock
from medley.runtime.collector import StepGarbageCollector
from medley.runtime.config import TrainConfig, TrainHooks, check_config, load_data
from medley.runtime.emulated_devices import slowdown_factors
from medley.runtime.executor import ACTION_CATEGORIES
from medley.runtime.lifecycle import StepWatchdog, phase_timeouts
from medley.runtime.memory import cuda_peak_bytes, probe_peak_bytes, reset_cuda_peak, resident_tensors
from medley.runtime.metrics import TensorBoardLog
from medley.runtime.optim import LrSchedule, optimizer_class, set_lr
from medley.runtime.precision import LossScaler, choose_dtype, unscale_and_clip
from medley.runtime.records import StepRecord
from medley.runtime.setup import RankSetup, build_rank
from medley.runtime.step_records import RecordMaker
from medley.runtime.step_stats import PendingStep, StatsInterval, StepTimer, to_device
from medley.runtime.torch_adapter import all_gather_single
from medley.runtime.train_progress import TrainProgress
from medley.spec.cluster_schema import printable

__all__ = ["StepRecord", "TrainConfig", "TrainHooks", "check_config", "load_data", "resolve_dtype",
           "run_dtype", "train"]


def train(plan: Plan, config: TrainConfig, hooks: TrainHooks | None = None, *,
          checkpoints: checkpoint.CheckpointStore | None = None) -> list[StepRecord]:
    """Train ``plan`` on this rank; rank 0 returns the records of the steps it ran. ``checkpoints``:
    the store of ``config.checkpoint.dir`` when the caller publishes its saves itself (the elastic
    rank, before a restart); by default the loop makes its own."""
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
    checkpoints = checkpoints or checkpoint.CheckpointStore.of(config.checkpoint)
    return _Loop(plan, config, hooks or TrainHooks(), setup, scaler, checkpoints).run()


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
                 scaler: LossScaler | None, checkpoints: checkpoint.CheckpointStore | None) -> None:
        self.plan, self.config, self.hooks, self.setup, self.scaler = plan, config, hooks, setup, scaler
        self.checkpoints = checkpoints
        self.step_index, self.step_lr = 0, config.optimizer.lr
        self.skipped_steps = 0  # fp16's skipped steps (checkpointed, whatever the precision)
        layout = plan.shared
        # The launching process checked the data and built any token cache: ranks map it.
        self.source = load_data(config, seq_len=layout.seq_len, vocab_size=layout.model.vocab_size,
                                verify=False)
        self.sequences = plan.sequences_per_step
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sq_norm = self._zero()
        late = _slowdown(plan, config, late=True)
        self.late_slowdown = None if late is None else late[setup.device_of_rank[self.rank]]
        self.interval = StatsInterval(world=self.world, device=setup.device,
                                      trace_actions=config.logging.trace_actions)
        self.timeouts = phase_timeouts(config.logging)
        if not setup.executor.carries_clip:  # clipping off, not fp16, no tied copies
            setup.executor.before_optim = self._count_norm
        else:
            setup.executor.on_clip = self._clip
        self.schedule = LrSchedule.of(config.optimizer)
        self.meta = {"model": dataclasses.asdict(layout.model), "data": self.source.fingerprint,
                     "optimizer": config.optimizer.name, "seq_len": layout.seq_len, "seed": config.data.seed,
                     "global_batch": self.sequences, "schedule": self.schedule.record(),
                     "hf_dir": None if config.model.hf_dir is None
                     else str(Path(config.model.hf_dir).resolve()),
                     "adapter": None if layout.adapter is None else layout.adapter.as_json(),
                     "init_from": None if config.model.init_from is None
                     else str(Path(config.model.init_from).resolve()),
                     "plan": [{"pp": group.pp, "dp": group.dp, "split": list(group.stage_layers),
                               "zero": [z.level for z in group.zero],
                               "tp": [group.tp_of(k) for k in range(group.pp)]} for group in plan.groups]}
        if not plan.asymmetric:
            self.meta["plan"] = self.meta["plan"][0]
        flops = formulas.megatron_flops_per_step(layout.model, batch_size=self.sequences,
                                                 seq_len=layout.seq_len)
        devices = [plan.cluster.devices[d].type for d in plan.devices]
        peak = sum(t.peak_flops(resolve_dtype(plan, config)) for t in devices)
        self.maker = RecordMaker(
            plan=plan, config=config, source=self.source, sequences=self.sequences,
            device_of_rank=setup.device_of_rank, rank=self.rank,
            on_cuda=setup.device.type == "cuda", fp16=scaler is not None,
            flops_per_peak=flops / peak if setup.device.type == "cuda" and peak > 0 else None)

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.setup.device)

    def _count_norm(self, stage: int, bucket: int | None) -> None:
        share = self.setup.stages[stage].grad_sq_norm(bucket, replica=self.setup.replica)
        self.sq_norm = self.sq_norm + share.to(self.setup.device)

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
        longest = self.timeouts.longest_s()
        watchdog = StepWatchdog(longest, rank=self.rank) if longest is not None else None
        dist.barrier()
        collector = StepGarbageCollector(self.config.logging.gc_every)
        try:
            collector.start()
            for step in range(start, self.config.optimizer.steps):
                self._arm(watchdog, step, first=step == start)
                self.interval.add(self._step(step))
                if self._gathers_after(step, start=start):
                    for record in self._records():
                        records.append(record)
                        if self.hooks.on_record is not None:
                            self.hooks.on_record(record)
                        self._log(record)
                        if board is not None:
                            board.write(record)
                        if progress is not None:
                            progress.update(record)
                    if progress is not None and records:
                        progress.logged(records[-1])
                if watchdog is not None:
                    watchdog.disarm()
                if self.hooks.on_computed is not None:
                    self.hooks.on_computed(step)
                self._maybe_save(step + 1, watchdog)
                if self.hooks.on_step is not None:
                    self.hooks.on_step(step)
                collector.after_step(step)
        finally:
            if self.checkpoints is not None:
                self.checkpoints.drop()  # a save still in flight after a failure is never published
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
        latest = checkpoint_layout.latest_checkpoint(self.config.checkpoint.dir)
        if latest is None:
            return 0
        state = self._train_state()
        start, changed = checkpoint.load_checkpoint(latest, stages=self.setup.stages, expected=self.meta,
                                                    reset_data_order=self.config.data.reset_data_order,
                                                    extend_schedule=self.config.optimizer.extend_schedule,
                                                    train_state=state)
        self.skipped_steps = int(state["skipped_steps"])
        if self.scaler is not None:
            self.scaler.load(state)
            self.scaler.skipped_steps = self.skipped_steps
        if self.rank == 0:
            for change in changed:
                print(printable(f"resuming {latest} with {change}"), file=sys.stderr, flush=True)
            print(printable(f"resumed from step {start} (checkpoint {latest}; {start * self.sequences:,} "
                            f"sequences seen; {self.schedule.describe()})"), file=sys.stderr, flush=True)
        return start

    def _arm(self, watchdog: StepWatchdog | None, step: int, *, first: bool) -> None:
        """Watch the step with its phase's limit (the first step's or the steady one)."""
        limit = self.timeouts.first_step_s if first else self.timeouts.step_s
        if watchdog is not None and limit is not None:
            watchdog.arm(step, timeout_s=limit, flag="--first-step-timeout" if first else "--step-timeout")

    def _gathers_after(self, step: int, *, start: int) -> bool:
        """Whether the ranks gather the statistics after ``step`` (every rank decides alike): the
        first step of the run, every ``log_every``-th, the last, one before a checkpoint, and an
        fp16 step after which no loss scale is left."""
        return (step == start or (step + 1) % self.config.logging.log_every == 0
                or step + 1 == self.config.optimizer.steps or self._saves_at(step + 1)
                or (self.scaler is not None and self.scaler.exhausted))

    def _saves_at(self, next_step: int) -> bool:
        every = self.config.checkpoint.every
        return self.checkpoints is not None and (
            next_step == self.config.optimizer.steps or (every > 0 and next_step % every == 0))

    def _maybe_save(self, next_step: int, watchdog: StepWatchdog | None) -> None:
        """The checkpoint before ``next_step`` when one is due (the statistics up to it were gathered
        and checked: a diverged state is never saved), watched with the checkpoint's limit."""
        if not self._saves_at(next_step):
            return
        assert self.checkpoints is not None  # _saves_at
        assert not self.interval, "a checkpoint comes after a gather"
        if watchdog is not None and self.timeouts.checkpoint_s is not None:
            watchdog.arm(next_step - 1, timeout_s=self.timeouts.checkpoint_s,
                         what=f"the checkpoint after step {next_step - 1}", flag="--checkpoint-timeout")
        last = next_step == self.config.optimizer.steps
        self.checkpoints.save(next_step=next_step, stages=self.setup.stages, meta=self.meta,
                              train_state=self._train_state(),
                              asynchronous=self.config.checkpoint.async_save and not last)
        if watchdog is not None:
            watchdog.disarm()

    def _train_state(self) -> dict[str, torch.Tensor]:
        """The loop's checkpointed scalars: the skipped steps (they hold back the learning-rate
        schedule) and, in fp16, the loss scale."""
        state = {"skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64)}
        return state if self.scaler is None else {**state, **self.scaler.state()}

    def _batch(self, step: int) -> MicroBatches:
        rows = self.source.global_rows(step=step, seed=self.config.data.seed, sequences=self.sequences,
                                       seq_len=self.plan.shared.seq_len)
        return self._slice(rows)

    def _slice(self, rows: Rows) -> MicroBatches:
        """This replica's micro-batches of ``rows``, cut and counted on the host (the learned-target
        count read from a device tensor would wait for the device), then copied to the device."""
        batch = replica_slice(rows, micro_batches=self.plan.micro_batches,
                              micro_batch_size=self.plan.shared.micro_batch_size, replica=self.setup.replica)
        device = self.setup.device
        segments = None if batch.segments is None else [to_device(t, device) for t in batch.segments]
        return dataclasses.replace(batch, inputs=[to_device(t, device) for t in batch.inputs],
                                   targets=[to_device(t, device) for t in batch.targets], segments=segments)

    def _step(self, step: int) -> PendingStep:
        """Run one step (and an evaluation when due); its statistics, left on the device."""
        config, setup = self.config, self.setup
        # The schedule counts applied updates: a skipped fp16 step holds it back (as Megatron-LM).
        self.step_index, self.step_lr = step, self.schedule.at(step - self.skipped_steps)
        for stage in setup.stages.values():
            for optimizer in stage.optimizers:
                set_lr(optimizer, self.step_lr)
        if self.scaler is not None:
            setup.executor.loss_scale = self.scaler.scale
        if self.late_slowdown is not None and step >= config.emulation.slowdown_from:
            setup.executor.slowdown = self.late_slowdown
        batch = self._batch(step)
        self.sq_norm = self._zero()
        setup.executor.emulated_sleep_s = 0.0
        reset_cuda_peak(setup.device)
        timer = StepTimer(setup.device)
        timer.start()
        losses = setup.executor.run_step(batch)
        timer.stop()
        executor = setup.executor
        spans = None
        if config.logging.trace_actions:  # this step's action timings (an evaluation makes its own)
            spans = (executor.action_origin, [(str(a), start, end) for a, (start, end) in
                                              zip(executor.program, executor.action_spans, strict=True)])
        peak = cuda_peak_bytes(setup.device) if setup.device.type == "cuda" else 0
        host = [executor.emulated_sleep_s, peak,
                executor.loss_scale, self.skipped_steps,
                float(self.scaler is not None and self.scaler.skipped_now),
                *(executor.action_s[c] for c in ACTION_CATEGORIES)]
        loss = self._own(losses)
        values = torch.stack([loss, self.sq_norm.to(setup.device), self._evaluate(step)])
        return PendingStep(step=step, lr=self.step_lr, device_values=values, timer=timer, host_values=host,
                           spans=spans, learned_tokens=batch.loss_tokens)

    def _evaluate(self, step: int) -> torch.Tensor:
        """This rank's share of the validation loss of the model after ``step`` (forward only,
        through the plan's pipeline), summed over the ``eval_batches`` batches; 0 when not due."""
        total = self._zero()
        if not self.config.eval_due(step):
            return total
        for index in range(self.config.logging.eval_batches):
            batch = self._slice(self.source.eval_rows(index, sequences=self.sequences))
            total = total + self._own(self.setup.executor.run_forward(batch))
        return total

    def _own(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The losses this rank adds to the step's statistics (their fp64 sum, on the device): every
        TP rank of the last stage computes them alike, so TP rank 0 alone counts them."""
        if self.setup.tp_rank != 0 or not losses:
            return self._zero()
        return torch.stack([loss.double() for loss in losses]).sum()

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
            self.skipped_steps = self.scaler.skipped_steps

    def _records(self) -> list[StepRecord]:
        """Collective: gather the pending steps' statistics; rank 0's records of them (every rank
        raises alike at the first diverged step, after the records before it)."""
        gathered = self.interval.gather()
        exhausted = self.scaler is not None and self.scaler.exhausted
        records = []
        for index, step in enumerate(gathered):
            last = index == len(gathered) - 1
            record = self.maker.record(step, exhausted=exhausted and last, skipped_steps=self.skipped_steps)
            if record is not None:
                records.append(record)
        return records

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
        all_gather_single(gathered, peak)
        memory = self.maker.by_device([int(peak) for peak in gathered.tolist()])
        for record in records:
            record.peak_memory_bytes = dict(memory)
        if self.rank == 0 and self.config.logging.log_jsonl is not None:
            append_text(Path(self.config.logging.log_jsonl),
                    json.dumps({"memory_probe": {str(k): v for k, v in memory.items()}}) + "\n")
