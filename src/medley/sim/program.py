"""Flatten a :class:`SimProblem` into per-device op tuples over one array of event times.

Every time the engine needs is a *slot* in ``Program.times`` (-1 until known): the end of each
F and of each B/BW, the arrival of each transfer, the end of each collective. Dependencies are
slot indices fixed here, so the engine's inner loop only compares floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from medley.cost.interfaces import Collective
from medley.schedule.ir import P2P_KINDS, Action, Kind, PipelineSchedule
from medley.sim.problem import SimProblem

ZERO_SLOT = 0  # always 0.0: "no dependency"
SINK_SLOT = 1  # written by actions nobody waits on (W, OPTIM)

OP_COMPUTE = 0  # (code, dur, dep, producer, local_dep, zero_dep, out, mem_start, mem_end, action, zero_inst)
OP_SEND = 1  # (code, transfer, producer_slot, action that produced it or the SEND itself)
OP_ISSUE = 2  # (code, collective instance)
OP_MEMORY = 3  # (code, alloc_bytes, free_bytes, action): local ZeRO action without communication

TRANSFER_F = 0  # activation going forward
TRANSFER_B = 1  # gradient going backward


@dataclass(kw_only=True, slots=True)
class Program:
    """What the engine executes. Devices are dense indices into ``device_ids``."""

    device_ids: list[int]
    replica_rank: list[tuple[int, int]]
    times: list[float]
    ops: list[list[tuple]]
    # transfers, by transfer id
    xfer_src: list[int] = field(default_factory=list)
    xfer_dst: list[int] = field(default_factory=list)
    xfer_dur: list[float] = field(default_factory=list)
    xfer_links: list[tuple[int, ...]] = field(default_factory=list)
    xfer_slot: list[int] = field(default_factory=list)
    xfer_info: list[tuple[int, int, int, int]] = field(default_factory=list)  # replica, F/B, stage, mb
    # collectives, by instance id
    coll_members: list[list[int]] = field(default_factory=list)
    coll_alloc: list[list[float]] = field(default_factory=list)
    coll_free: list[list[float]] = field(default_factory=list)
    coll_dur: list[float] = field(default_factory=list)
    coll_links: list[tuple[int, ...]] = field(default_factory=list)
    coll_slot: list[int] = field(default_factory=list)
    coll_action: list[Action] = field(default_factory=list)
    coll_seq: list[list[int]] = field(default_factory=list)  # per device, instances in issue order
    link_names: list[str] = field(default_factory=list)
    device_start: list[float] = field(default_factory=list)  # when each device's program starts


class _Builder:
    def __init__(self, problem: SimProblem) -> None:
        self.problem = problem
        self.dense: dict[int, int] = {}
        replica_rank: list[tuple[int, int]] = []
        for r, row in enumerate(problem.devices):
            for k, device in enumerate(row):
                self.dense[device] = len(self.dense)
                replica_rank.append((r, k))
        n = len(self.dense)
        self.prog = Program(
            device_ids=list(self.dense), replica_rank=replica_rank, times=[0.0, 0.0],
            ops=[[] for _ in range(n)], coll_seq=[[] for _ in range(n)],
        )
        prog = self.prog
        self.add_transfer = (prog.xfer_src.append, prog.xfer_dst.append, prog.xfer_dur.append,
                             prog.xfer_links.append, prog.xfer_slot.append, prog.xfer_info.append)
        self.link_ids: dict[str, int] = {}
        self.path_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self.routes: dict[tuple[int, bool, int], tuple] = {}
        self.coll_index: dict[tuple, int] = {}
        # Per group tuple the table hands out (by identity, the tuple kept alive here): a number
        # for it and each member's position, so that a replica's collective costs O(1), not O(dp).
        self.group_ids: dict[tuple[int, ...], int] = {}
        self.group_seen: dict[int, tuple[tuple[int, ...], int, dict[int, int]]] = {}
        self.rings: dict[int, tuple[int, ...]] = {}  # group number -> the links of its ring
        self.bases: list[int] = []
        for schedule in problem.schedules:
            self.bases.append(len(self.prog.times))
            self.prog.times.extend([-1.0] * (4 * schedule.num_stages * schedule.num_micro_batches))

    # slot layout of replica r: [done_f | done_b | arrive_f | arrive_b], each stage-major
    def slot(self, r: int, region: int, stage: int, mb: int) -> int:
        schedule = self.problem.schedules[r]
        m = schedule.num_micro_batches
        if not 0 <= mb < m:
            raise ValueError(f"replica {r}: micro-batch {mb} out of range 0..{m - 1}")
        return self.bases[r] + (region * schedule.num_stages + stage) * m + mb

    def links(self, src: int, dst: int) -> tuple[int, ...]:
        key = (src, dst)
        if key not in self.path_cache:
            comm = self.problem.comm
            names = comm.path_links(src, dst) if comm is not None else ()
            self.path_cache[key] = tuple(self.link_ids.setdefault(name, len(self.link_ids)) for name in names)
        return self.path_cache[key]

    def build(self) -> Program:
        for r, schedule in enumerate(self.problem.schedules):
            lowered = not P2P_KINDS.isdisjoint({a.kind for row in schedule.actions for a in row})
            for k, row in enumerate(schedule.actions):
                self.build_rank(r, k, schedule, row, lowered)
        for inst, members in enumerate(self.prog.coll_members):
            if any(alloc is None for alloc in self.prog.coll_alloc[inst]):
                allocs = self.prog.coll_alloc[inst]
                missing = [self.prog.device_ids[m] for m, a in zip(members, allocs, strict=True) if a is None]
                raise ValueError(
                    f"collective {self.prog.coll_action[inst]} over devices "
                    f"{[self.prog.device_ids[m] for m in members]} is never issued by devices {missing}; "
                    "every member of a DP group must issue the same collectives in the same order"
                )
        self.prog.link_names = list(self.link_ids)
        self.prog.device_start = [self.problem.start_s.get(d, 0.0) for d in self.prog.device_ids]
        return self.prog

    def build_rank(
        self, r: int, k: int, schedule: PipelineSchedule, row: list[Action], lowered: bool
    ) -> None:
        device = self.dense[self.problem.devices[r][k]]
        measured = self.problem.duration_overrides.get(self.problem.devices[r][k])
        s2r = schedule.stage_to_rank
        last = schedule.num_stages - 1
        costs = self.problem.stage_costs[r]
        ops = self.prog.ops[device]
        append = ops.append
        m = schedule.num_micro_batches
        spans = schedule.micro_batch_stages  # empty: every micro-batch runs stages 0..last
        # slot of (region, s, mb) is base + region * stride + s * m + mb
        base, stride = self.bases[r], schedule.num_stages * m
        unshard: dict[int, int] = {}  # stage -> latest UNSHARD instance listed so far
        reduce: dict[tuple[int, int | None], int] = {}  # (stage, bucket) -> latest REDUCE_GRAD instance
        live_grad: dict[int, float] = {}  # stage -> unsharded gradient bytes not yet reduced
        occurrences: dict[tuple[Kind, int, int | None], int] = {}
        coll_slot = self.prog.coll_slot
        kind_f, kind_b, kind_w, kind_bw = Kind.F, Kind.B, Kind.W, Kind.BW
        send_f, send_b = Kind.SEND_F, Kind.SEND_B
        for action in row:
            kind, s, mb = action.kind, action.stage, action.micro_batch
            if s > last or s2r[s] != k:
                raise ValueError(f"replica {r} rank {k}: action {action} does not belong to this rank")
            if mb is not None and mb >= m:
                raise ValueError(f"replica {r} rank {k}: action {action} names micro-batch {mb} of only {m}")
            if kind is kind_f or kind is kind_b or kind is kind_w or kind is kind_bw:
                assert mb is not None
                cost = costs[s]
                here = base + s * m + mb
                dep = producer = local = ZERO_SLOT
                # A micro-batch's chain (both ends) is the whole pipeline except in two-direction
                # schedules, whose up micro-batches enter at stage p.
                first, end = spans[mb] if spans else (0, last)
                if kind is kind_f:
                    dur, out, mem_start, mem_end = cost.forward_s, here, cost.activation_bytes, 0.0
                    if s > first:
                        producer = here - m
                        dep = producer if s2r[s - 1] == k else producer + 2 * stride
                    send = not lowered and s < end and s2r[s + 1] != k
                elif kind is kind_w:
                    dur, out, mem_start = cost.backward_weight_s, SINK_SLOT, 0.0
                    mem_end = cost.activation_after_b_bytes
                    local = here + stride
                    send = False
                else:
                    split = kind is kind_b
                    dur = cost.backward_input_s + (0.0 if split else cost.backward_weight_s)
                    out, mem_start, local = here + stride, 0.0, here
                    mem_end = cost.activation_bytes - (cost.activation_after_b_bytes if split else 0.0)
                    if s < end:
                        producer = here + stride + m
                        dep = producer if s2r[s + 1] == k else producer + 2 * stride
                    send = not lowered and s > first and s2r[s - 1] != k
                if measured:
                    dur = measured.get(action, dur)
                if kind is not kind_f:  # the backward's workspace, for as long as it runs
                    mem_start += cost.workspace_bytes
                    mem_end += cost.workspace_bytes
                if (kind is kind_w or kind is kind_bw) and live_grad.get(s, 0.0) <= 0.0:
                    # (Re)allocated by the first weight gradient after the last reduction freed it.
                    # The gradient grows as this backward frees its activations and workspace, so
                    # the action holds the larger of its start (those) and its end (the gradient):
                    # the gradient's excess over what it frees is booked at the start, the rest
                    # of the freeing at the end.
                    grad = live_grad[s] = cost.grad_buffer_bytes
                    mem_start += max(0.0, grad - mem_end)
                    mem_end = max(0.0, mem_end - grad)
                zero_inst = unshard.get(s, -1)
                zero_dep = coll_slot[zero_inst] if zero_inst >= 0 else ZERO_SLOT
                append((OP_COMPUTE, dur, dep, producer, local, zero_dep, out, mem_start, mem_end, action,
                        zero_inst))
                if send:  # the SEND add_send_recv would place right after this action
                    append(self.send_op(r, k, kind is kind_f, s, mb, s2r, action))
            elif kind is send_f or kind is send_b:
                assert mb is not None
                append(self.send_op(r, k, kind is send_f, s, mb, s2r, action))
            elif kind in P2P_KINDS:
                continue  # receives are posted early; the consumer waits for the arrival slot
            else:
                self.zero_op(r, device, action, occurrences, unshard, reduce, ops, live_grad, measured)

    def send_op(
        self, r: int, k: int, forward: bool, s: int, mb: int, s2r: tuple[int, ...], action: Action
    ) -> tuple:
        route = self.routes.get((r, forward, s))
        if route is None:
            route = self.routes[(r, forward, s)] = self.route(r, k, forward, s, s2r, action)
        src, dst, dur, links, producer_region, arrival_region = route
        add_src, add_dst, add_dur, add_links, add_slot, add_info = self.add_transfer
        xid = len(self.prog.xfer_src)
        add_src(src)
        add_dst(dst)
        add_dur(dur)
        add_links(links)
        add_slot(arrival_region + mb)
        add_info((r, TRANSFER_F if forward else TRANSFER_B, s, mb))
        return (OP_SEND, xid, producer_region + mb, action)

    def route(self, r: int, k: int, forward: bool, s: int, s2r: tuple[int, ...], action: Action) -> tuple:
        """(src, dst, duration, links, producer slot - mb, arrival slot - mb) of a stage's sends."""
        peer = s + 1 if forward else s - 1
        if not 0 <= peer < len(s2r):
            raise ValueError(f"replica {r} rank {k}: a send of {action} goes past the end of the pipeline")
        row = self.problem.devices[r]
        src, dst = row[k], row[s2r[peer]]
        owner = self.problem.stage_costs[r][s if forward else peer]
        nbytes = owner.send_bytes if forward or owner.send_back_bytes is None else owner.send_back_bytes
        comm = self.problem.comm
        dur = comm.p2p_time(src, dst, nbytes) if comm is not None else 0.0
        producer = self.slot(r, 0 if forward else 1, s, 0)
        arrival = self.slot(r, 2 if forward else 3, s, 0)
        return (self.dense[src], self.dense[dst], dur, self.links(src, dst), producer, arrival)

    def zero_op(self, r, device, action, occurrences, unshard, reduce, ops, live_grad, measured=None) -> None:
        cost = self.problem.collectives(r, action)
        if measured and action.kind is Kind.OPTIM and action in measured:
            cost = replace(cost, compute_s=measured[action])
        if action.kind is Kind.REDUCE_GRAD:
            # A reduction frees at most the unsharded gradient still live (none after a round
            # of forwards only); rounding leftovers below one byte count as freed.
            freed = min(cost.free_bytes, live_grad.get(action.stage, 0.0))
            live_grad[action.stage] = live_grad.get(action.stage, 0.0) - freed
            if live_grad[action.stage] < 1.0:
                live_grad[action.stage] = 0.0
            if freed != cost.free_bytes:
                cost = replace(cost, free_bytes=freed)
        me = self.prog.device_ids[device]
        group_id, position = self.group(cost.group)
        if me not in position:
            raise ValueError(f"replica {r}: collective table gives {action} the group {cost.group}, "
                             f"which lacks the issuing device {me}")
        if action.kind is Kind.OPTIM:
            # Behind a CLIP the step waits for the world-wide norm, which (collective streams
            # being FIFO) ends after every reduction listed before it.
            inst = reduce.get(_CLIP_KEY, -1)
            if inst < 0:
                inst = reduce.get((action.stage, action.bucket), reduce.get((action.stage, None), -1))
            zero_dep = self.prog.coll_slot[inst] if inst >= 0 else ZERO_SLOT
            ops.append((OP_COMPUTE, cost.compute_s, ZERO_SLOT, ZERO_SLOT, ZERO_SLOT, zero_dep, SINK_SLOT,
                        cost.alloc_bytes, cost.free_bytes, action, inst))
            return
        if cost.op is None or len(cost.group) == 1:
            ops.append((OP_MEMORY, cost.alloc_bytes, cost.free_bytes, action))
            return
        key3 = (action.kind, cost.unit) if cost.unit is not None else (action.kind, _group_stage(action),
                                                                        action.bucket)
        nth = occurrences.get(key3, 0)
        occurrences[key3] = nth + 1
        if action.kind is Kind.REDUCE_GRAD and nth > 0 and cost.alloc_bytes:
            # A bucket's reduction buffers exist once per step: later reductions of the same
            # bucket (streamed ZeRO-3, gradient windows) accumulate into them.
            cost = replace(cost, alloc_bytes=0.0)
        inst = self.instance(cost.group, action, nth, cost.op, cost.nbytes, cost.compute_s, key3,
                             group_id=group_id)
        slot_in_group = position[me]
        self.prog.coll_alloc[inst][slot_in_group] = cost.alloc_bytes
        self.prog.coll_free[inst][slot_in_group] = cost.free_bytes
        self.prog.coll_seq[device].append(inst)
        if action.kind is Kind.UNSHARD:
            unshard[action.stage] = inst
        elif action.kind is Kind.REDUCE_GRAD:
            reduce[(action.stage, action.bucket)] = inst
            reduce[(action.stage, None)] = inst
        elif action.kind is Kind.CLIP:
            reduce[_CLIP_KEY] = inst
        ops.append((OP_ISSUE, inst))

    def group(self, group: tuple[int, ...]) -> tuple[int, dict[int, int]]:
        """(the number of ``group``, each member's position in it); O(len(group)) only the first
        time this tuple object (or an equal one, from a table that builds a tuple per call) is seen."""
        seen = self.group_seen.get(id(group))
        if seen is None or seen[0] is not group:
            number = self.group_ids.setdefault(group, len(self.group_ids))
            seen = self.group_seen[id(group)] = (group, number, {d: i for i, d in enumerate(group)})
        return seen[1], seen[2]

    def instance(
        self, group: tuple[int, ...], action: Action, nth: int, op: Collective, nbytes: float,
        extra_s: float = 0.0, identity: tuple | None = None, *, group_id: int | None = None,
    ) -> int:
        if identity is None:
            identity = (action.kind, _group_stage(action), action.bucket)
        if group_id is None:
            group_id = self.group(group)[0]
        key = (group_id, *identity, nth)
        inst = self.coll_index.get(key)
        if inst is not None:
            return inst
        prog, comm = self.prog, self.problem.comm
        unknown = [d for d in group if d not in self.dense]
        if unknown:
            raise ValueError(f"collective {action}: group {group} names devices {unknown} that run no rank")
        inst = self.coll_index[key] = len(prog.coll_members)
        prog.coll_members.append([self.dense[d] for d in group])
        prog.coll_alloc.append([None] * len(group))
        prog.coll_free.append([None] * len(group))
        prog.coll_dur.append(comm.collective_time(op, group, nbytes) + extra_s if comm is not None else 0.0)
        ring = self.rings.get(group_id)
        if ring is None:  # the links of the group's ring, once per group
            links = {link for i, d in enumerate(group) for link in self.links(d, group[(i + 1) % len(group)])}
            ring = self.rings[group_id] = tuple(sorted(links))
        prog.coll_links.append(ring)
        prog.coll_slot.append(len(prog.times))
        prog.times.append(-1.0)
        prog.coll_action.append(action)
        return inst


_CLIP_KEY = (-1, None)  # where a rank's latest CLIP instance is kept among its reductions


def _group_stage(action: Action) -> int:
    """The stage that identifies a collective across its members: a CLIP spans every rank, each
    of which names its own first stage, so it is matched by order alone."""
    return -1 if action.kind is Kind.CLIP else action.stage


def build_program(problem: SimProblem) -> Program:
    return _Builder(problem).build()
