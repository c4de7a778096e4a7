"""Turn the engine's raw per-device numbers into a :class:`SimResult`."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from medley.schedule.ir import Action, Kind
from medley.sim.problem import SimProblem
from medley.sim.result import DeviceReport, SimResult, StageZeroReport, Transfer
from medley.sim.run_state import RunRecord


def assemble_result(problem: SimProblem, run: RunRecord) -> SimResult:
    prog = run.prog
    xfer_end = [prog.times[slot] for slot in prog.xfer_slot]
    coll_end = [prog.times[slot] for slot in prog.coll_slot]
    last_compute = [timeline[-1][1] if timeline else 0.0 for timeline in run.compute]
    step = max([*last_compute, *xfer_end, *coll_end, 0.0])
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
        parts = _Attribution(run, d, coll_end)
        parts.run(step)
        replica, rank = prog.replica_rank[d]
        devices.append(DeviceReport(
            device=device_id, replica=replica, rank=rank, busy_s=run.busy[d], idle_s=step - run.busy[d],
            head_idle_s=first, interior_idle_s=max(0.0, (last - first) - run.busy[d]),
            tail_idle_s=step - last, bubble_s=parts.bubble, exposed_transfer_s=parts.transfer,
            exposed_zero_s=parts.zero, exposed_clip_s=parts.clip, clip_barrier_s=parts.barrier,
            static_memory_bytes=static, peak_memory_bytes=max(memory[device_id][1]), step_time_s=step,
        ))
        members = problem.tp_members.get(device_id, ())
        if members:  # a TP group's other ranks: copies of the lead
            lead = devices[-1] = replace(devices[-1], tp=1 + len(members))
        for j, member in enumerate(members, start=1):
            devices.append(replace(lead, device=member, tp_rank=j))
            memory[member], compute[member] = memory[device_id], timeline
        for stage, comm_s in parts.zero_comm.items():
            report = zero.setdefault(stage, StageZeroReport(stage=stage, comm_s=0.0, exposed_s=0.0))
            report.comm_s = max(report.comm_s, comm_s)
            report.exposed_s = max(report.exposed_s, parts.zero_by_stage.get(stage, 0.0))
    peak = sum(problem.peak_flops.get(report.device, 0.0) for report in devices)
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
        executed_ops=run.executed_ops,
    )


class _Attribution:
    """Splits one device's idle time into bubble, exposed transfer, exposed ZeRO, exposed CLIP
    all-reduce and clipping barrier (the rules: :mod:`medley.sim.result`).

    The engine has split each wait before a compute action at the moment its data (activation,
    gradient, local producer) was there: before that, the wait is bubble up to the producer's end
    and exposed transfer from there to the arrival (the engine sums the latter); after it, the
    action waited for a collective (``RunRecord.collective_waits``). That collective wait, like
    the tail after the last compute action, is laid over the device's own collectives, which run
    one at a time on its collective stream (sorted and disjoint): time inside a ZeRO collective
    is exposed ZeRO (of that collective's stage), inside a CLIP exposed CLIP; time before a
    collective starts, waiting for other members to issue it, is the clipping barrier when that
    collective is a CLIP and bubble otherwise. Bubble is what idle time remains.
    """

    def __init__(self, run: RunRecord, d: int, coll_end: list[float]) -> None:
        self.run_record, self.d = run, d
        prog = run.prog
        seq = prog.coll_seq[d]
        self.inst = seq
        self.starts = [run.coll_start[i] for i in seq]
        self.ends = [coll_end[i] for i in seq]
        self.is_clip = [prog.coll_action[i].kind is Kind.CLIP for i in seq]
        self.transfer = run.exposed_transfer[d]
        self.bubble = self.zero = self.clip = self.barrier = 0.0
        self.zero_by_stage: dict[int, float] = {}
        self.zero_comm: dict[int, float] = {}
        for i, start, end, clip in zip(seq, self.starts, self.ends, self.is_clip, strict=True):
            if not clip:
                stage = prog.coll_action[i].stage
                self.zero_comm[stage] = self.zero_comm.get(stage, 0.0) + (end - start)

    def run(self, step: float) -> None:
        record = self.run_record
        actions = record.prog.coll_action
        for data, start, inst in record.collective_waits[self.d]:
            self._over_collectives(data, start, inst >= 0 and actions[inst].kind is Kind.CLIP)
        timeline = record.compute[self.d]
        last = timeline[-1][1] if timeline else 0.0
        if step > last:
            self._over_collectives(last, step, False)
        idle = step - record.busy[self.d]
        self.bubble = max(0.0, idle - self.transfer - self.zero - self.clip - self.barrier)

    def _over_collectives(self, lo: float, hi: float, clip_after: bool) -> None:
        """Attribute the idle span [lo, hi] by the device's collectives; any part after the last
        of them is the clipping barrier if ``clip_after`` (the blocking collective is a CLIP),
        else bubble (left to the remainder)."""
        prog = self.run_record.prog
        cursor = lo
        j = bisect_right(self.ends, lo)
        while j < len(self.inst) and self.starts[j] < hi and cursor < hi:
            begin, finish = max(cursor, self.starts[j]), min(hi, self.ends[j])
            if begin > cursor and self.is_clip[j]:  # waiting for the other ranks to reach CLIP
                self.barrier += begin - cursor
            if finish > begin:
                if self.is_clip[j]:
                    self.clip += finish - begin
                else:
                    self.zero += finish - begin
                    stage = prog.coll_action[self.inst[j]].stage
                    self.zero_by_stage[stage] = self.zero_by_stage.get(stage, 0.0) + finish - begin
            cursor = max(cursor, finish)
            j += 1
        if hi > cursor and clip_after:
            self.barrier += hi - cursor


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
