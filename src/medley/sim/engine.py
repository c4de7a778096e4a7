"""Discrete-event simulation of one training step.

Resources and rules (the contract the planner and the runtime rely on):

* Each device has one **compute stream** running its compute actions (F, B, W, BW, OPTIM) in list
  order. A compute action starts when the previous one has ended and its inputs are there: the
  activation or gradient it consumes (local: the producer's end; remote: the transfer's arrival),
  the latest UNSHARD of its stage listed before it (OPTIM: the latest REDUCE_GRAD of its stage, or
  the CLIP listed before it).
* Non-compute actions are **issued** when the device's program reaches them, that is when every
  compute action listed before them has ended (``program point``).
* A **transfer** (SEND_F/SEND_B) is ready at its program point. It runs on the sender's **p2p
  stream** (FIFO in list order) and occupies every link ``comm.path_links(src, dst)`` names.
  Receives are posted early (an asynchronous irecv), so the receiver's RECV position never delays
  a transfer; the consumer just waits for the arrival.
* A **collective** starts once every member of its group has issued it, every member's
  **collective stream** is free (FIFO in each member's list order), and its ring's links are free;
  it occupies all of them for its whole duration.
* **Links serialise**: a link carries one transfer or collective at a time, first come (earliest
  ready) first served, at the full duration the cost model gives. This is pessimistic against
  bandwidth sharing for short overlaps but keeps the engine a single pass and makes contention
  visible in the timeline.

Events are processed in time order through one heap holding only communication (transfers and
collectives); compute between two communication events is propagated directly along each
device's program, which is what makes ~100k-action schedules simulate in well under a second.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from heapq import heappop, heappush

from medley.schedule.ir import Action, Kind
from medley.sim.problem import SimProblem
from medley.sim.program import (
    OP_COMPUTE,
    OP_ISSUE,
    OP_SEND,
    TRANSFER_F,
    Program,
    build_program,
)
from medley.sim.report import assemble_result
from medley.sim.result import SimResult
from medley.sim.run_state import RunRecord


class SimulationError(RuntimeError):
    """The schedule cannot run: a deadlock, or an action before the action it needs."""


class _Run:
    """Mutable state of one simulation; ``advance`` and ``book_*`` are the hot paths."""

    def __init__(self, prog: Program) -> None:
        n = len(prog.ops)
        self.prog = prog
        self.pc = [0] * n
        self.clock = list(prog.device_start) or [0.0] * n  # compute stream free = program point
        self.blocked_on = [-1] * n
        self.busy = [0.0] * n
        self.exposed_transfer = [0.0] * n
        self.collective_waits: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]
        self.compute: list[list[tuple[float, float, Action]]] = [[] for _ in range(n)]
        self.mem_events: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.p2p_free = [0.0] * n
        self.coll_stream_free = [0.0] * n
        self.link_free = [0.0] * max(1, len(prog.link_names))
        self.xfer_start = [0.0] * len(prog.xfer_src)
        ncoll = len(prog.coll_members)
        self.coll_start = [0.0] * ncoll
        self.coll_issued = [0] * ncoll
        self.coll_issue_time = [0.0] * ncoll
        self.coll_pushed = [False] * ncoll
        self.coll_head = [0] * n
        self.heap: list[tuple[float, int]] = []  # (ready, transfer id >= 0 or ~collective id)
        # What book_transfer reads per transfer, bound once (the hot path).
        self.xfer = (prog.xfer_src, prog.xfer_links, prog.xfer_dur, prog.xfer_slot, prog.xfer_dst)
        # What advance reads per device, bound once: its ops, their count, its timeline and memory.
        self.device = [(prog.ops[d], len(prog.ops[d]), self.compute[d], self.mem_events[d]) for d in range(n)]

    def advance(self, d: int) -> None:
        """Run device d's program until it blocks on a communication that has not arrived."""
        times = self.prog.times
        ops, n, timeline, mem = self.device[d]
        i, t = self.pc[d], self.clock[d]
        busy, exposed_transfer = self.busy[d], self.exposed_transfer[d]
        heap = self.heap
        while i < n:
            op = ops[i]
            code = op[0]
            if code == OP_COMPUTE:
                _, dur, dep, producer, local, zero_dep, out, mem_start, mem_end, action, zero_inst = op
                arrival, ready_local, collective = times[dep], times[local], times[zero_dep]
                if ready_local < 0 or (dep == producer and arrival < 0):
                    raise SimulationError(self._order_error(d, action))
                if arrival < 0:
                    self.blocked_on[d] = dep
                    break
                if collective < 0:
                    self.blocked_on[d] = zero_dep
                    break
                base = t if t > ready_local else ready_local
                data = base if base > arrival else arrival
                start = data if data > collective else collective
                if start > t:  # a wait, split as medley.sim.result says
                    produced = times[producer]
                    exposed_transfer += data - (base if base > produced else produced)
                    if start > data:  # past the data: laid over the collectives by the report
                        self.collective_waits[d].append((data, start, zero_inst))
                t = start + dur
                times[out] = t
                busy += dur
                timeline.append((start, t, action))
                if mem_start:
                    mem.append((start, mem_start))
                if mem_end:
                    mem.append((t, -mem_end))
            elif code == OP_SEND:
                if times[op[2]] < 0:
                    raise SimulationError(self._order_error(d, op[3]))
                heappush(heap, (t, op[1]))
            elif code == OP_ISSUE:
                inst = op[1]
                self.coll_issued[inst] += 1
                if t > self.coll_issue_time[inst]:
                    self.coll_issue_time[inst] = t
                self._try_push(inst)
            else:  # OP_MEMORY
                if op[1]:
                    mem.append((t, op[1]))
                if op[2]:
                    mem.append((t, -op[2]))
            i += 1
        self.pc[d], self.clock[d] = i, t
        self.busy[d], self.exposed_transfer[d] = busy, exposed_transfer

    def _try_push(self, inst: int) -> None:
        prog = self.prog
        members = prog.coll_members[inst]
        if self.coll_pushed[inst] or self.coll_issued[inst] < len(members):
            return
        ready = self.coll_issue_time[inst]
        for m in members:
            if prog.coll_seq[m][self.coll_head[m]] != inst:
                return
            if self.coll_stream_free[m] > ready:
                ready = self.coll_stream_free[m]
        self.coll_pushed[inst] = True
        heappush(self.heap, (ready, ~inst))

    def book_transfer(self, ready: float, x: int) -> None:
        link_free, p2p_free = self.link_free, self.p2p_free
        xfer_src, xfer_links, xfer_dur, xfer_slot, xfer_dst = self.xfer
        src = xfer_src[x]
        start = ready if ready > p2p_free[src] else p2p_free[src]
        links = xfer_links[x]
        for link in links:
            if link_free[link] > start:
                start = link_free[link]
        end = start + xfer_dur[x]
        p2p_free[src] = end
        for link in links:
            link_free[link] = end
        self.xfer_start[x] = start
        slot = xfer_slot[x]
        self.prog.times[slot] = end
        dst = xfer_dst[x]
        if self.blocked_on[dst] == slot:
            self.blocked_on[dst] = -1
            self.advance(dst)

    def book_collective(self, ready: float, inst: int) -> None:
        prog, link_free = self.prog, self.link_free
        members = prog.coll_members[inst]
        start = ready
        for m in members:
            if self.coll_stream_free[m] > start:
                start = self.coll_stream_free[m]
        for link in prog.coll_links[inst]:
            if link_free[link] > start:
                start = link_free[link]
        end = start + prog.coll_dur[inst]
        for link in prog.coll_links[inst]:
            link_free[link] = end
        self.coll_start[inst] = start
        slot = prog.coll_slot[inst]
        prog.times[slot] = end
        for j, m in enumerate(members):
            self.coll_stream_free[m] = end
            self.coll_head[m] += 1
            if prog.coll_alloc[inst][j]:
                self.mem_events[m].append((start, prog.coll_alloc[inst][j]))
            if prog.coll_free[inst][j]:
                self.mem_events[m].append((end, -prog.coll_free[inst][j]))
        for m in members:
            if self.blocked_on[m] == slot:
                self.blocked_on[m] = -1
                self.advance(m)
        for m in members:
            if self.coll_head[m] < len(prog.coll_seq[m]):
                self._try_push(prog.coll_seq[m][self.coll_head[m]])

    def run(self) -> None:
        for d in range(len(self.prog.ops)):
            self.advance(d)
        heap = self.heap
        while heap:
            ready, x = heappop(heap)
            if x >= 0:
                self.book_transfer(ready, x)
            else:
                self.book_collective(ready, ~x)
        stuck = [d for d in range(len(self.prog.ops)) if self.pc[d] < len(self.prog.ops[d])]
        if stuck:
            raise SimulationError(self._deadlock_error(stuck))

    def record(self) -> RunRecord:
        return RunRecord(
            prog=self.prog, busy=self.busy, compute=self.compute, mem_events=self.mem_events,
            exposed_transfer=self.exposed_transfer, collective_waits=self.collective_waits,
            xfer_start=self.xfer_start, coll_start=self.coll_start,
            executed_ops=sum(self.pc),  # each device's program counter: the ops it ran
        )

    def _where(self, d: int) -> str:
        r, k = self.prog.replica_rank[d]
        return f"device {self.prog.device_ids[d]} (replica {r}, rank {k})"

    def _order_error(self, d: int, action: Action) -> str:
        return (f"{self._where(d)} reaches {action} before the action on the same rank that it needs; "
                "list the producer (F before its B, B before its W, compute before its SEND) first")

    def _deadlock_error(self, stuck: list[int]) -> str:
        lines = []
        for d in stuck[:8]:
            op = self.prog.ops[d][self.pc[d]]
            action = op[9] if op[0] == OP_COMPUTE else op
            lines.append(f"{self._where(d)} waits at {action}{self._waiting_for(d)}")
        return "deadlock: no device can make progress:\n  " + "\n  ".join(lines)

    def _waiting_for(self, d: int) -> str:
        slot = self.blocked_on[d]
        prog = self.prog
        if slot in prog.coll_slot:
            inst = prog.coll_slot.index(slot)
            members = [prog.device_ids[m] for m in prog.coll_members[inst]]
            return f" for collective {prog.coll_action[inst]} over devices {members}"
        if slot in prog.xfer_slot:
            r, direction, s, mb = prog.xfer_info[prog.xfer_slot.index(slot)]
            kind = Kind.SEND_F if direction == TRANSFER_F else Kind.SEND_B
            return f" for the transfer {Action(s, kind, mb)} of replica {r}, which never became ready"
        return " for a transfer that no rank ever sends (missing SEND?)"


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with Python's cycle collector off (as it was before, after). The engine
    allocates ~10 acyclic tuples per action, and the planner's search millions of small tuples and
    arrays: the collector would rescan them over and over (a third of the run time at 100k
    actions) and find nearly nothing to free; what it would have found is freed on leaving."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(problem: SimProblem) -> SimResult:
    """Simulate one training step of ``problem``; raises :class:`SimulationError` if it cannot run."""
    with collector_paused():
        prog = build_program(problem)
        run = _Run(prog)
        run.run()
        return assemble_result(problem, run.record())
