"""The files an elastic run keeps beside its checkpoints, in ``<checkpoint dir>/elastic/``.

* ``heartbeat.json``: the reporting rank after every step: when, how many steps were done, the
  newest checkpoint's step and the torchrun run id. A node that joins tells a running job from a
  finished or dead one by it, and after a failure it says how far the lost attempt had come.
* ``state.json``: the plan in force and the devices it was made for (the devices present then).
* ``plans/plan-NNNN.toml``: each plan made by a re-plan, numbered in order.
* ``events.jsonl``: one record per event (a node lost or joined, a straggler, a stop).
* ``stopped.json``: the line that stopped the run (too few devices for any plan); the restarted
  ranks of the same run find it and stop at once instead of failing the same way again.
* ``join-NODE``, ``admit-NODE``: a node that joins asks to be admitted; the ranks answer at their
  next checkpoint, once it is written, and wait there for the agents to restart them with it.

Pure files, no torch: the joining agent (:mod:`medley.launch.local_agent`) reads them before it
imports torch. Nothing here follows a symbolic link: an ``elastic`` that is a link is refused,
writes replace files by rename, and reads open without following links.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from medley.errors import MedleyInputError
from medley.fileio import append_text, open_no_follow, write_atomically

SUBDIR = "elastic"
HEARTBEAT = "heartbeat.json"
STATE = "state.json"
PLANS = "plans"
EVENTS = "events.jsonl"
STOPPED = "stopped.json"
LIVE_S = 30.0  # a heartbeat older than this is a run that ended or died
_MAX_JSON = 1 << 20


def elastic_dir(checkpoint_dir: Path | str) -> Path:
    """``<checkpoint dir>/elastic``, created; a symbolic link there is refused (it would make the
    run write outside the checkpoint directory)."""
    path = Path(checkpoint_dir) / SUBDIR
    if path.is_symlink():
        raise MedleyInputError(f"--checkpoint-dir {checkpoint_dir}: {path} is a symbolic link; medley writes "
                               "only inside --checkpoint-dir: delete the link")
    path.mkdir(parents=True, exist_ok=True)
    (path / PLANS).mkdir(exist_ok=True)
    if (path / PLANS).is_symlink():
        raise MedleyInputError(f"--checkpoint-dir {checkpoint_dir}: {path / PLANS} is a symbolic link; "
                               "delete the link")
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(data, indent=1) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, a link, too big or not an object."""
    try:
        with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as handle:
            data = json.loads(handle.read(_MAX_JSON + 1)[:_MAX_JSON] or b"null")
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def live_heartbeat(directory: Path, *, now: float | None = None) -> dict[str, Any] | None:
    """The heartbeat of a run that is training now (written within ``LIVE_S``), else None."""
    beat = read_json(directory / HEARTBEAT)
    when = None if beat is None else beat.get("time")
    if not isinstance(when, (int, float)):
        return None
    return beat if (time.time() if now is None else now) - when <= LIVE_S else None


def join_file(directory: Path, node: str) -> Path:
    return directory / f"join-{node}"


def admit_file(directory: Path, node: str) -> Path:
    return directory / f"admit-{node}"


def join_requests(directory: Path) -> list[str]:
    """The nodes that asked to join, sorted."""
    return sorted(p.name.removeprefix("join-") for p in directory.glob("join-*") if p.is_file())


def append_event(directory: Path, record: dict[str, Any]) -> None:

    append_text(directory / EVENTS, json.dumps(record, allow_nan=False) + "\n")


def events(directory: Path) -> list[dict[str, Any]]:
    """The event records written so far (unreadable lines skipped)."""
    path = directory / EVENTS
    if not path.is_file() or path.is_symlink():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
