"""Turn the engine's raw per-device numbers into a :class:`SimResult`."""

from __future__ import annotations

from medley.schedule.ir import Action, Kind
from medley.sim.problem import SimProblem
from medley.sim.result import DeviceReport, SimResult, StageZeroReport, Transfer
from medley.sim.run_state import RunRecord


def assemble_result(problem: SimProblem, run: RunRecord) -> SimResult:
    prog = run.prog
    xfer_end = [prog.times[slot] for slot in prog.xfer_slot]
    coll_end = [prog.times[slot] for slot in prog.coll_slot]
    step = max([*run.clock, *xfer_end, *coll_end, 0.0])
    zero_comm, zero_tail = _zero_per_device(run, coll_end)
    devices: list[DeviceReport] = []
    memory: dict[int, tuple[list[float], list[float]]] = {}
    compute: dict[int, list[tuple[float, float, Action]]] = {}
    zero: dict[int, StageZeroReport] = {}
    for d, device_id in enumerate(prog.device_ids):
        timeline = run.compute[d]
        first = timeline[0][0] if timeline else step
        last = timeline[-1][1] if timeline else step
        static = problem.static_memory_bytes.get(device_id, 0.0)
        memory[device_id] = _memory_series(static, run.mem_events[d])
        compute[device_id] = timeline
        exposed_zero = dict(run.exposed_zero[d])
        for stage, tail in zero_tail[d].items():
            exposed_zero[stage] = exposed_zero.get(stage, 0.0) + max(0.0, tail - last)
        replica, rank = prog.replica_rank[d]
        devices.append(DeviceReport(
            device=device_id, replica=replica, rank=rank, busy_s=run.busy[d], idle_s=step - run.busy[d],
            head_idle_s=first, interior_idle_s=max(0.0, (last - first) - run.busy[d]),
            tail_idle_s=step - last, exposed_p2p_s=run.exposed_p2p[d],
            exposed_zero_s=sum(exposed_zero.values()), static_memory_bytes=static,
            peak_memory_bytes=max(memory[device_id][1]), step_time_s=step,
        ))
        for stage, comm_s in zero_comm[d].items():
            report = zero.setdefault(stage, StageZeroReport(stage=stage, comm_s=0.0, exposed_s=0.0))
            report.comm_s = max(report.comm_s, comm_s)
            report.exposed_s = max(report.exposed_s, exposed_zero.get(stage, 0.0))
    peak = sum(problem.peak_flops.get(device_id, 0.0) for device_id in prog.device_ids)
    return SimResult(
        step_time_s=step,
        devices=devices,
        zero=dict(sorted(zero.items())),
        tokens_per_s=problem.tokens_per_step / step if step > 0 else 0.0,
        mfu=problem.model_flops_per_step / (step * peak) if step > 0 and peak > 0 else 0.0,
        compute=compute,
        transfers=_transfers(run, xfer_end),
        collectives=[
            (tuple(prog.device_ids[m] for m in members), run.coll_start[i], coll_end[i], prog.coll_action[i])
            for i, members in enumerate(prog.coll_members)
        ],
        memory=memory,
        link_names=list(prog.link_names),
    )


def _zero_per_device(
    run: RunRecord, coll_end: list[float]
) -> tuple[list[dict[int, float]], list[dict[int, float]]]:
    """Per device and stage: summed collective time, and the latest end of its collectives."""
    prog = run.prog
    comm: list[dict[int, float]] = [{} for _ in prog.ops]
    latest: list[dict[int, float]] = [{} for _ in prog.ops]
    for inst, members in enumerate(prog.coll_members):
        stage = prog.coll_action[inst].stage
        for m in members:
            comm[m][stage] = comm[m].get(stage, 0.0) + prog.coll_dur[inst]
            latest[m][stage] = max(latest[m].get(stage, 0.0), coll_end[inst])
    # Only the collective ending last on a device can be exposed past its last compute.
    tails: list[dict[int, float]] = []
    for ends in latest:
        if ends:
            stage = max(ends, key=ends.__getitem__)
            tails.append({stage: ends[stage]})
        else:
            tails.append({})
    return comm, tails


def _memory_series(static: float, events: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Memory level from each event time on. At equal times frees sort first (negative deltas), so
    a buffer freed at the instant another is allocated never counts twice, and the level after
    the last event at a time is the highest the device reaches at that time."""
    events.sort()
    times, levels = [0.0], [static]
    level = static
    for t, delta in events:
        level += delta
        if t == times[-1]:
            levels[-1] = level
        else:
            times.append(t)
            levels.append(level)
    return times, levels


def _transfers(run: RunRecord, xfer_end: list[float]) -> list[Transfer]:
    prog = run.prog
    ids = prog.device_ids
    kinds = (Kind.SEND_F, Kind.SEND_B)
    return [
        (ids[prog.xfer_src[x]], ids[prog.xfer_dst[x]], run.xfer_start[x], xfer_end[x], replica,
         kinds[direction], stage, mb)
        for x, (replica, direction, stage, mb) in enumerate(prog.xfer_info)
    ]
