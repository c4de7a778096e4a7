"""Which plan an elastic run trains under now, decided by its leading rank from who is present.

The agents start one rank per device of the *launched* plan on their node (the pool), so a rank's
device is its node's LOCAL_RANK-th pool device whatever plan is in force. The plan in force
(``state.json``) is kept while the devices present are the ones it was made for; otherwise the
run is re-planned for the devices present (:func:`medley.elastic.replan.replan`), the new plan
written to ``plans/plan-NNNN.toml`` and made the one in force. What changed becomes an event:
a node lost or joined, a straggler re-planned, or a restart on the same devices.

A fresh launch (another torchrun run id than the state's) starts from the launched plan.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from medley.elastic.replan import describe, replan
from medley.errors import MedleyInputError
from medley.fileio import remove_path
from medley.launch import elastic_dir
from medley.plan.plan import Plan, load_plan, save_plan
from medley.runtime.checkpoint_layout import latest_checkpoint, step_of
from medley.runtime.placement import plan_devices_by_node

_PLAN_NAME = re.compile(r"plan-\d{4}\.toml")


@dataclass(frozen=True, kw_only=True)
class Member:
    """One started rank, as it says at start-up: its torchrun rank, node and local rank."""

    rank: int
    node: str
    local_rank: int


@dataclass(kw_only=True)
class Decision:
    """What every rank of the elastic world is told.

    Attributes:
        plan: the plan file in force (absolute path).
        device: the pool device of every started rank, by torchrun rank.
        trainers: the torchrun ranks that train under it, in the order of their training ranks
            (a started rank whose device the plan leaves out waits instead).
        event: what changed (:func:`event_record` keys), or None.
        error: why the run stops (every rank raises it); None when it goes on.
    """

    plan: str = ""
    device: dict[int, int] = field(default_factory=dict)
    trainers: list[int] = field(default_factory=list)
    event: dict[str, Any] | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "device": {str(k): v for k, v in self.device.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Decision:
        return cls(plan=raw["plan"], device={int(k): int(v) for k, v in raw["device"].items()},
                   trainers=[int(r) for r in raw["trainers"]], event=raw.get("event"), error=raw.get("error"))


def pool_devices(launched: Plan, members: Sequence[Member]) -> dict[int, int]:
    """Each member's pool device: the ``local_rank``-th device of the launched plan on its node."""
    pool = plan_devices_by_node(launched)
    out = {}
    for member in members:
        devices = pool.get(member.node, [])
        if member.local_rank >= len(devices):
            raise MedleyInputError(
                f"rank {member.rank} (node '{member.node}', local rank {member.local_rank}) has no device of "
                f"the launched plan: it uses {len(devices)} there; start the node's agent with medley launch "
                "--elastic")
        out[member.rank] = devices[member.local_rank]
    return out


def _in_force(directory: Path, launched: Plan, launched_path: Path,
              run_id: str) -> tuple[Plan, Path, list[int]]:
    """(plan, its file, the devices it was made for): the state's within one run, else the launched."""
    state = elastic_dir.read_json(directory / elastic_dir.STATE)
    if state is not None and state.get("run_id") == run_id and isinstance(state.get("plan"), str) \
            and _PLAN_NAME.fullmatch(state["plan"]) and isinstance(state.get("present"), list):
        path = directory / elastic_dir.PLANS / state["plan"]
        if path.is_file() and not path.is_symlink():
            return load_plan(path), path, sorted(int(d) for d in state["present"])
    return launched, launched_path, sorted(launched.devices)


def _next_plan_path(directory: Path) -> Path:
    numbers = [int(p.name[5:9]) for p in (directory / elastic_dir.PLANS).glob("plan-*.toml")
               if _PLAN_NAME.fullmatch(p.name)]
    return directory / elastic_dir.PLANS / f"plan-{max(numbers, default=0) + 1:04d}.toml"


def _nodes(plan: Plan, devices: Sequence[int]) -> list[str]:
    names = {plan.cluster.devices[d].node for d in devices}
    return [n.name for n in plan.cluster.nodes if n.name in names]


def decide(launched: Plan, launched_path: Path, checkpoint_dir: Path, members: Sequence[Member], *,
           run_id: str, restarted: bool, slower: Mapping[int, float] | None = None,
           check: Callable[[Plan], None] | None = None) -> Decision:
    """The leading rank's decision (see the module doc). ``restarted``: the agents restarted the
    ranks (a failure or a node that joined); ``slower``: devices measured slow (id: factor) to
    re-plan for now; ``check``: the memory pre-flight of ``medley train`` for a new plan."""
    directory = elastic_dir.elastic_dir(checkpoint_dir)
    device = pool_devices(launched, members)
    present = sorted(set(device.values()))
    current, current_path, made_for = _in_force(directory, launched, launched_path, run_id)
    kind, nodes = None, []
    if present != made_for:
        lost = _nodes(launched, [d for d in made_for if d not in present])
        joined = _nodes(launched, [d for d in present if d not in made_for])
        kind, nodes = ("node lost", lost) if lost and not joined else \
            ("node joined", joined) if joined and not lost else ("nodes changed", lost + joined)
    elif slower:
        kind, nodes = "straggler", _nodes(launched, list(slower))
    elif restarted:
        kind = "restart"
    plan, plan_path = current, current_path
    event = None if kind is None else _event(kind, nodes, directory, checkpoint_dir, current, present, slower)
    if kind not in (None, "restart"):
        try:
            plan = replan(current, present, slower=slower)
            if check is not None:
                check(plan)
        except MedleyInputError as err:
            return Decision(device=device, event=event, error=str(err))
        plan_path = _next_plan_path(directory)
        save_plan(plan, plan_path)
    kept = plan_path.name if plan_path.parent == directory / elastic_dir.PLANS else None
    state = {"run_id": run_id, "plan": kept, "present": present}
    elastic_dir.write_json(directory / elastic_dir.STATE, state)
    if event is not None:
        event["new_plan"] = describe(plan)
        event["plan_file"] = str(plan_path)
    used = set(plan.devices)
    trainers = sorted(r for r, d in device.items() if d in used)
    for node in _nodes(launched, present):  # admitted: their requests are answered
        remove_path(elastic_dir.join_file(directory, node))
        remove_path(elastic_dir.admit_file(directory, node))
    return Decision(plan=str(plan_path.resolve()), device=device, trainers=trainers, event=event)


def _event(kind: str, nodes: list[str], directory: Path, checkpoint_dir: Path, current: Plan,
           present: list[int], slower: Mapping[int, float] | None) -> dict[str, Any]:
    """The event as known at the decision: the heartbeat says how far the last attempt came."""
    beat = elastic_dir.read_json(directory / elastic_dir.HEARTBEAT) or {}
    latest = latest_checkpoint(checkpoint_dir)
    resumed = 0 if latest is None else step_of(latest)
    reached = beat.get("step") if isinstance(beat.get("step"), int) else resumed
    when = beat.get("time")
    if not isinstance(when, (int, float)) or kind == "straggler":
        when = time.time()
    return {"event": kind, "nodes": nodes, "old_plan": describe(current), "devices": present,
            "slower": {str(d): round(f, 3) for d, f in (slower or {}).items()},
            "resumed_from": resumed, "steps_redone": max(0, reached - resumed), "since": when}
