"""One rank of an elastic run (``medley launch --elastic``): who is here, which plan, then train.

torchrun's elastic agents start one rank per device of the launched plan on every node present
and restart them all when a node is lost (a failure, counted against ``--max-restarts``) or one
joins (a membership change). Each start of the ranks goes:

1. Every rank says who it is (node, local rank) in a store that torchrun rank 0 hosts
   (``MASTER_ADDR:MASTER_PORT``); nothing else is shared before the plan is known.
2. Rank 0 decides the plan (:func:`medley.elastic.decide.decide`: the plan in force, or a
   re-plan for the devices present) and posts the decision; every rank reads it.
3. The ranks on the plan's devices make the training process group among themselves (their own
   store prefix, ranks in device order) and train from the newest complete checkpoint
   (:func:`medley.runtime.train.train`); a rank the plan leaves out waits for them to end.

While training, :class:`Watch` writes the heartbeat after every step, finishes the pending event
at the first step (the time from the event to it), and at every checkpoint asks the others one
question: does a node wait to join (then the ranks wait there for the agents to restart them
with it), or has a device been a straggler (then rank 0 re-plans at its measured speed and the
same ranks go on under the new plan from that checkpoint, without a restart)?
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from medley.elastic.decide import Decision, Member, decide
from medley.errors import MedleyInputError
from medley.fileio import append_text, remove_path
from medley.launch import elastic_dir
from medley.launch.spawn import STORE_TIMEOUT_S, init_process_group
from medley.lowering.predict import simulate_groups
from medley.plan.plan import Plan, load_plan
from medley.runtime.checkpoint import CheckpointStore
from medley.runtime.config import TrainConfig, TrainHooks
from medley.runtime.metrics import TensorBoardLog
from medley.runtime.placement import DEVICE_ENV, NODE_ENV
from medley.runtime.records import StepRecord
from medley.runtime.train import train
from medley.spec.cluster_schema import printable

_POLL_S = 0.5
_WARMUP_STEPS = 2  # the first steps of each plan are not judged (allocation, first-touch)
_CONTINUE, _ADMIT, _REPLAN = 0, 1, 2


class Replan(Exception):  # noqa: N818 - a request, not a failure
    """Raised on every training rank at a checkpoint where a straggler was found."""


def run_rank(launched: Plan, config: TrainConfig, hooks: TrainHooks | None, *, plan_path: Path,
             check: Callable[[Plan], None] | None = None) -> tuple[list[StepRecord], Plan] | None:
    """The body of an elastic rank (``medley.launch.spawn.rank_main``'s ``body``): the records
    and their plan on the rank that reports, None elsewhere. ``check`` is ``medley train``'s
    pre-flight for a plan."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "medley")
    assert config.checkpoint.dir is not None  # check_config: --elastic needs it
    directory = elastic_dir.elastic_dir(config.checkpoint.dir)
    _stop_if_stopped(directory, run_id, rank)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    store.set(f"member/{rank}", json.dumps({"node": os.environ.get(NODE_ENV, ""),
                                            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or _was_running(directory, run_id)
    slower: dict[int, float] = {}
    for round_ in range(1_000):
        if rank == 0:
            members = [Member(rank=r, **json.loads(store.get(f"member/{r}"))) for r in range(world)]
            decision = decide(launched, plan_path, Path(config.checkpoint.dir), members, run_id=run_id,
                              restarted=restarted or round_ > 0, slower=slower, check=check)
            if decision.error is not None:
                _record_stop(directory, run_id, decision)
            store.set(f"decision/{round_}", json.dumps(decision.as_json()))
        decision = Decision.from_json(json.loads(store.get(f"decision/{round_}")))
        if decision.error is not None:
            raise MedleyInputError(decision.error)
        if rank not in decision.trainers:
            if _wait_out(store, round_) == "replan":
                slower = _slower(store, round_)
                continue
            return _leave(store, round_, rank, world)
        plan = load_plan(Path(decision.plan))
        os.environ[DEVICE_ENV] = str(decision.device[rank])
        init_process_group(config, store=dist.PrefixStore(f"train/{round_}/", store),
                           rank=decision.trainers.index(rank), world_size=len(decision.trainers))
        checkpoints = CheckpointStore.of(config.checkpoint)
        assert checkpoints is not None  # check_config: --elastic needs a checkpoint directory
        watch = Watch(directory=directory, config=config, plan=plan, decision=decision, run_id=run_id,
                      user=hooks or TrainHooks(), checkpoints=checkpoints)
        try:
            records = train(plan, config_for(plan, config), watch.hooks(), checkpoints=checkpoints)
        except Replan:
            if dist.get_rank() == 0:
                store.set(f"slower/{round_}", json.dumps({str(d): f for d, f in watch.flagged.items()}))
                store.set(f"end/{round_}", "replan")
            dist.destroy_process_group()
            slower = _slower(store, round_)
            continue
        reports = dist.get_rank() == 0
        if reports:
            store.set(f"end/{round_}", "done")
        dist.destroy_process_group()
        _leave(store, round_, rank, world)
        return (records, plan) if reports else None
    raise RuntimeError("an elastic run re-planned 1,000 times without a restart: a bug in medley.elastic")


def config_for(plan: Plan, config: TrainConfig) -> TrainConfig:
    """``config`` for ``plan``: emulated slowdowns kept for the devices it uses only."""
    emulation, used = config.emulation, set(plan.devices)
    kept = {d: f for d, f in emulation.slowdown.items() if d in used}
    emulate = emulation.emulate or bool(emulation.slowdown)  # --slowdown implies --emulate, kept or not
    kept_emulation = dataclasses.replace(emulation, slowdown=kept, emulate=emulate)
    return dataclasses.replace(config, emulation=kept_emulation)


def _slower(store: dist.Store, round_: int) -> dict[int, float]:
    return {int(d): float(f) for d, f in json.loads(store.get(f"slower/{round_}")).items()}


def _was_running(directory: Path, run_id: str) -> bool:
    """Whether this run trained before (a node that joined restarts ranks without counting)."""
    beat = elastic_dir.read_json(directory / elastic_dir.HEARTBEAT)
    return beat is not None and beat.get("run_id") == run_id


def _wait_out(store: dist.Store, round_: int) -> str:
    """A rank the plan leaves out: wait for the trainers' end of ``round_`` (done or replan)."""
    while not store.check([f"end/{round_}"]):
        time.sleep(_POLL_S)
    return store.get(f"end/{round_}").decode()


def _leave(store: dist.Store, round_: int, rank: int, world: int) -> None:
    """Say goodbye; rank 0, which hosts the store, waits (briefly) until every rank has."""
    store.set(f"bye/{round_}/{rank}", "1")
    if rank == 0:
        try:
            store.wait([f"bye/{round_}/{r}" for r in range(world)], datetime.timedelta(seconds=30))
        except (RuntimeError, dist.DistError):
            pass
    return None


def _record_stop(directory: Path, run_id: str, decision: Decision) -> None:
    elastic_dir.write_json(directory / elastic_dir.STOPPED, {"run_id": run_id, "line": decision.error,
                                                             "time": time.time()})
    event = dict(decision.event or {"event": "stop"})
    event.update(stopped=decision.error, since=None)
    elastic_dir.append_event(directory, event)


def _stop_if_stopped(directory: Path, run_id: str, rank: int) -> None:
    """The ranks the agents restart after the run stopped (too few devices) stop at once, quietly."""
    stopped = elastic_dir.read_json(directory / elastic_dir.STOPPED)
    if stopped is None:
        return
    if stopped.get("run_id") == run_id:
        raise SystemExit(2)
    if rank == 0:
        remove_path(directory / elastic_dir.STOPPED)


@dataclasses.dataclass(kw_only=True)
class Watch:
    """The training ranks' elastic duties, as :class:`TrainHooks` around the user's."""

    directory: Path
    config: TrainConfig
    plan: Plan
    decision: Decision
    run_id: str
    user: TrainHooks
    checkpoints: CheckpointStore  # the round's, which the loop saves into
    flagged: dict[int, float] = dataclasses.field(default_factory=dict)
    _runs: dict[int, int] = dataclasses.field(default_factory=dict)
    _first: list[dict[int, float]] = dataclasses.field(default_factory=list)
    _steps: int = 0
    _predicted: dict[int, float] | None = None

    def hooks(self) -> TrainHooks:
        return dataclasses.replace(self.user, on_step=self.on_step, on_record=self.on_record,
                                   on_computed=self.beat)

    def on_record(self, record: StepRecord) -> None:
        """Rank 0, for each step's record (made at the logged step after it: the first step's at
        once): the pending event at the first step, the straggler watch."""
        now = time.time()
        first = self._steps == 0
        self._steps += 1
        if first and self.decision.event is not None:
            self._finish_event(self.decision.event, record, now)
        self._watch_speed(record)
        if self.user.on_record is not None:
            self.user.on_record(record)

    def beat(self, step: int) -> None:
        """Rank 0's heartbeat once a step's compute is done (every step, records or not), before
        its checkpoint: a node lost during the save leaves the step counted as done."""
        if dist.get_rank() == 0:
            beat = {"time": time.time(), "step": step + 1, "run_id": self.run_id,
                    "plan": Path(self.decision.plan).name}
            elastic_dir.write_json(self.directory / elastic_dir.HEARTBEAT, beat)

    def on_step(self, step: int) -> None:
        """Every training rank, after each step and its checkpoint: at a checkpoint, the question."""
        every, steps = self.config.checkpoint.every, self.config.optimizer.steps
        if every > 0 and (step + 1) % every == 0 and step + 1 < steps:
            answer = torch.tensor([self._answer() if dist.get_rank() == 0 else 0], dtype=torch.int64)
            dist.broadcast(answer, 0)
            if int(answer) != _CONTINUE:
                self.checkpoints.finish()  # what the restart or the new plan resumes from
            if int(answer) == _ADMIT:
                self._admit()
            elif int(answer) == _REPLAN:
                raise Replan
        if self.user.on_step is not None:
            self.user.on_step(step)

    def _answer(self) -> int:
        if elastic_dir.join_requests(self.directory):
            return _ADMIT
        return _REPLAN if self.flagged else _CONTINUE

    def _admit(self) -> None:
        """The checkpoint is written: let the waiting nodes in and wait to be restarted with them."""
        waiting = elastic_dir.join_requests(self.directory)
        if dist.get_rank() == 0:
            for node in waiting:
                elastic_dir.write_json(elastic_dir.admit_file(self.directory, node), {"time": time.time()})
            _say(f"elastic: admitting node(s) {', '.join(waiting)} at this checkpoint; the ranks restart "
                 "with them")
        deadline = time.monotonic() + self.config.elastic.admit_wait_s
        while time.monotonic() < deadline:  # the agents stop these ranks to restart them with the new node
            time.sleep(_POLL_S)
        dist.barrier()
        if dist.get_rank() == 0:
            for node in waiting:
                remove_path(elastic_dir.join_file(self.directory, node))
                remove_path(elastic_dir.admit_file(self.directory, node))
            _say(f"elastic: node(s) {', '.join(waiting)} did not join within "
                 f"{self.config.elastic.admit_wait_s:g} s; training goes on without them")

    def _finish_event(self, event: dict[str, Any], record: StepRecord, now: float) -> None:
        since = event.get("since")
        event = {**event, "first_step": record.step, "first_step_at": now,
                 "recovery_s": None if not isinstance(since, (int, float)) else round(now - since, 3)}
        elastic_dir.append_event(self.directory, event)
        if self.config.logging.log_jsonl is not None:
            append_text(Path(self.config.logging.log_jsonl), json.dumps({"event": event}) + "\n")
        line = event_line(event)
        if self.config.logging.tensorboard is not None:
            board = TensorBoardLog(Path(self.config.logging.tensorboard))
            board.write_event(record.step, line, recovery_s=event["recovery_s"],
                              steps_redone=event["steps_redone"])
            board.close()
        _say(line)

    def _watch_speed(self, record: StepRecord) -> None:
        """Each device's compute per step over the plan's prediction for it, relative to the median
        device's (a change of every device is no straggler), against the same figure over the
        plan's first judged steps (its baseline: on CPU the prediction is not calibrated per
        stage). More than the margin above its baseline ``straggler_steps`` steps in a row, and
        the device is flagged, at the factor it slowed down by."""
        elastic = self.config.elastic
        if elastic.straggler_steps == 0 or self._steps <= _WARMUP_STEPS or self.flagged:
            return
        if self._predicted is None:
            _, result = simulate_groups(self.plan.groups, self.plan.cluster, comm=False)
            self._predicted = {r.device: r.busy_s for r in result.devices if r.busy_s > 0}
        measured = record.action_time_by_device
        ratios = {d: times["compute"] / self._predicted[d] for d, times in measured.items()
                  if d in self._predicted and times.get("compute", 0.0) > 0}
        if len(ratios) < 2:
            return
        median = statistics.median(ratios.values())
        relative = {d: ratio / median for d, ratio in ratios.items()}
        if len(self._first) < elastic.straggler_steps:
            self._first.append(relative)
            return
        for device, slow in relative.items():
            baseline = statistics.median(first.get(device, slow) for first in self._first)
            factor = slow / baseline
            self._runs[device] = self._runs.get(device, 0) + 1 if factor > 1 + elastic.straggler_margin else 0
            if self._runs[device] >= elastic.straggler_steps:
                self.flagged[device] = factor  # on top of the speed the plan already takes it at
                _say(f"elastic: device {device} computes {factor:.2f}x slower than at the start of this "
                     f"plan, relative to the others, for {self._runs[device]} steps; re-planning at its "
                     "measured speed at the next checkpoint")


def event_line(event: dict[str, Any]) -> str:
    """One line for the log: what happened, the old and the new plan, recovery and redone steps."""
    nodes = f" ({', '.join(event['nodes'])})" if event.get("nodes") else ""
    recovery = event.get("recovery_s")
    took = "" if recovery is None else f"; {recovery:.1f} s from the event to step {event['first_step']}"
    plans = f"{event['old_plan']} -> {event.get('new_plan', '?')}"
    return printable(f"elastic: {event['event']}{nodes}: {plans}; "
                     f"resumed from the checkpoint of step {event['resumed_from']}, "
                     f"{event['steps_redone']} step(s) redone{took}")


def _say(line: str) -> None:
    print(printable(line), file=sys.stderr, flush=True)
