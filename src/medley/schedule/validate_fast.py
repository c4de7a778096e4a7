"""A fast proof that a compute-only schedule passes :func:`medley.schedule.validate.validate`.

The planner validates every distinct program it simulates (thousands of actions each), and the
validator's action-object sets made that half of a search. :func:`runs_cleanly` checks the same
rules on integer indices and answers True only when the full validator would raise nothing; on
False (a rule broken, or a schedule outside its reach) the full validator runs and names the rule.

Its reach: schedules whose micro-batches all flow through every stage (no ``micro_batch_stages``)
and that hold no SEND/RECV yet (the validator then lowers them with
:func:`medley.schedule.ir.add_send_recv`). For those, the lowered schedule's point-to-point rules
hold by construction once the compute rules do: each SEND and RECV is generated once, next to
the compute action that needs it, and its peer exists because every (stage, micro-batch) runs. The
lowering follows the levels of :func:`medley.schedule.ir.compute_order`: each SEND right after its
producer, each RECV before the consumer rank's first action of a later level than that producer.
So each rank pair receives in the order it sends, and the lowered program runs to its end even
when each batch of transfers waits for the other ends of its messages (NCCL): level by level, the
compute actions of a level run and then the messages they produced are exchanged. Its
zero-duration execution reduces to the compute actions alone, where a consumer waits exactly for
its producer's compute action, on whichever rank.
"""

from __future__ import annotations

from medley.schedule.ir import COLLECTIVE_KINDS, Kind, PipelineSchedule

_F, _B, _W, _BW = 0, 1, 2, 3
_CODE = {Kind.F: _F, Kind.B: _B, Kind.W: _W, Kind.BW: _BW}


def runs_cleanly(schedule: PipelineSchedule) -> bool:
    """True when ``schedule`` (shape already checked) keeps every rule of the validator but the
    activation limit: placement, exactly-once, per-rank order, completeness, send/recv matching
    and deadlock freedom. False says nothing: run the full validator."""
    if schedule.micro_batch_stages:
        return False
    encoded = _encoded(schedule)
    if encoded is None:
        return False
    rows, seen = encoded
    return _complete(seen) and _executes(rows, schedule)


def _encoded(schedule: PipelineSchedule) -> tuple[list[list[tuple[int, int]]], list[bytearray]] | None:
    """Each rank's compute actions as (kind code, stage * micro-batches + micro-batch), checked
    against the validator's placement, exactly-once and order rules, with the flags of the
    (stage, micro-batch) pairs each kind ran for (None when a rule breaks or a SEND/RECV is
    present)."""
    stages, m = schedule.num_stages, schedule.num_micro_batches
    s2r = schedule.stage_to_rank
    seen = [bytearray(stages * m) for _ in range(4)]
    f, b, w, bw = seen
    rows: list[list[tuple[int, int]]] = []
    for rank, row in enumerate(schedule.actions):
        out: list[tuple[int, int]] = []
        for action in row:
            kind = action.kind
            if kind in COLLECTIVE_KINDS:
                continue
            code = _CODE.get(kind)
            s, mb = action.stage, action.micro_batch
            if code is None or mb is None or s >= stages or mb >= m or s2r[s] != rank:
                return None
            i = s * m + mb
            if code == _F:
                if f[i] or b[i] or bw[i]:
                    return None
            elif code == _W:
                if w[i] or not b[i]:
                    return None
            elif not f[i] or b[i] or bw[i] or w[i]:
                return None
            seen[code][i] = 1
            out.append((code, i))
        rows.append(out)
    return rows, seen


def _complete(seen: list[bytearray]) -> bool:
    """Every (stage, micro-batch) ran one F and one backward, a split one with its W."""
    f, b, w, bw = seen
    return 0 not in f and b == w and all(x | y for x, y in zip(b, bw, strict=True))


def _executes(rows: list[list[tuple[int, int]]], schedule: PipelineSchedule) -> bool:
    """Zero-duration execution: an F waits for the F of the stage before, a backward for its F and
    the backward of the stage after, a W for its B; each rank runs its row in order."""
    m = schedule.num_micro_batches
    n = schedule.num_stages * m
    f_done, b_done = bytearray(n), bytearray(n)
    cursor = [0] * len(rows)
    progress = True
    while progress:
        progress = False
        for rank, row in enumerate(rows):
            j = start = cursor[rank]
            end = len(row)
            while j < end:
                code, i = row[j]
                if code == _F:
                    if i >= m and not f_done[i - m]:
                        break
                    f_done[i] = 1
                elif code == _W:
                    if not b_done[i]:
                        break
                else:
                    if not f_done[i] or (i + m < n and not b_done[i + m]):
                        break
                    b_done[i] = 1
                j += 1
            if j != start:
                cursor[rank] = j
                progress = True
    return all(cursor[r] == len(row) for r, row in enumerate(rows))
