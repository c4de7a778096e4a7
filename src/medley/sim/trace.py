"""Chrome trace JSON (open it in https://ui.perfetto.dev or chrome://tracing).

One process per device; threads for compute, outgoing transfers, incoming transfers and
collectives; a flow arrow from each send to its receive; a memory counter track per device.
Times are microseconds, as the format wants.
"""

from __future__ import annotations

import json
from pathlib import Path

from medley.fileio import write_atomically
from medley.sim.result import SimResult

COMPUTE_TID, SEND_TID, RECV_TID, COLLECTIVE_TID = 0, 1, 2, 3
_THREADS = {COMPUTE_TID: "compute", SEND_TID: "p2p send", RECV_TID: "p2p recv", COLLECTIVE_TID: "collectives"}
_GIB = float(1 << 30)


def _us(seconds: float) -> float:
    return seconds * 1e6


def _metadata(result: SimResult, roles: dict[int, str]) -> list[dict]:
    events = []
    for report in result.devices:
        pid = report.device
        tp = f", tp rank {report.tp_rank} of {report.tp}" if report.tp > 1 else ""
        role = f"; {roles[pid]}" if pid in roles else ""
        label = f"device {pid} (replica {report.replica}, rank {report.rank}{tp}{role})"
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
        events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        for tid, name in _THREADS.items():
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
    return events


def _slice(pid: int, tid: int, name: str, cat: str, start: float, end: float, **args) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": _us(start),
            "dur": _us(end - start), "args": args}


def chrome_trace_events(result: SimResult, roles: dict[int, str] | None = None) -> list[dict]:
    """The trace events of ``result``; ``roles``: a description per device id added to its name
    (its replica group's shape and its layers, say)."""
    events = _metadata(result, roles or {})
    for device, timeline in result.compute.items():
        for start, end, action in timeline:
            events.append(_slice(device, COMPUTE_TID, str(action), action.kind.value, start, end,
                                 stage=action.stage, micro_batch=action.micro_batch))
    for flow_id, (src, dst, start, end, replica, kind, stage, mb) in enumerate(result.transfers):
        name = f"{stage}{kind.value}{mb}"
        args = {"replica": replica, "from": src, "to": dst}
        events.append(_slice(src, SEND_TID, name, "p2p", start, end, **args))
        events.append(_slice(dst, RECV_TID, name.replace("SEND", "RECV"), "p2p", start, end, **args))
        events.append({"ph": "s", "pid": src, "tid": SEND_TID, "id": flow_id, "name": "transfer",
                       "cat": "p2p", "ts": _us(start)})
        events.append({"ph": "f", "bp": "e", "pid": dst, "tid": RECV_TID, "id": flow_id, "name": "transfer",
                       "cat": "p2p", "ts": _us(start)})
    for members, start, end, action in result.collectives:
        for device in members:
            events.append(_slice(device, COLLECTIVE_TID, str(action), "collective", start, end,
                                 group=list(members)))
    for device, (times, levels) in result.memory.items():
        for t, level in zip(times, levels, strict=True):
            events.append({"ph": "C", "pid": device, "name": "memory", "ts": _us(t),
                           "args": {"GiB": level / _GIB}})
    return events


def write_chrome_trace(result: SimResult, path: str | Path, *, roles: dict[int, str] | None = None) -> Path:
    """Write ``result`` as Chrome trace JSON to ``path`` and return the path."""
    path = Path(path)
    payload = {"traceEvents": chrome_trace_events(result, roles), "displayTimeUnit": "ms",
               "otherData": {"step_time_s": result.step_time_s, "tokens_per_s": result.tokens_per_s,
                             "mfu": result.mfu}}
    write_atomically(path, json.dumps(payload))
    return path
