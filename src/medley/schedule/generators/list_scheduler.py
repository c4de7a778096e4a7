"""Greedy list scheduler behind the cost-driven families (zero-bubble, bidirectional).

Modelled on the zero-bubble paper's ``manual_order`` heuristic (research/schedules_sim.md §2.2):
actions are placed one at a time in order of their earliest start, using per-stage F/B/W costs;
on each rank a ready backward goes first, then a ready forward if the activation limit allows it,
and a deferred weight-gradient W only fills time the rank would otherwise sit idle (or frees
memory when the limit blocks the next forward). Communication is not modelled: the result is an
order, the simulator times it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from medley.schedule.ir import Action, Kind

StageCost = tuple[float, float, float]


@dataclass(kw_only=True)
class _Stage:
    """Progress of one stage: its micro-batches in order and how far F and B have got."""

    index: int
    rank: int
    micro_batches: list[int]
    next_f: int = 0
    next_b: int = 0
    pending_w: deque[int] = field(default_factory=deque)


def list_schedule(
    *,
    stage_to_rank: Sequence[int],
    spans: Sequence[tuple[int, int]],
    costs: Sequence[StageCost],
    split_backward: bool,
    stage_limit: Sequence[int],
    rank_limit: Sequence[float] | None = None,
) -> list[list[Action]]:
    """Order every stage's F and backward (B + W, or BW) for the micro-batches' ``spans``.

    ``stage_limit[s]`` caps the forwards of stage s still waiting for their backward (B or BW),
    which sets the warm-up depth (1F1B: p-s). ``rank_limit[r]`` caps the micro-batches whose
    activations rank r holds, from F until W (or BW): the memory budget that bounds how far Ws
    may be deferred. Raises ValueError when the limits leave no action able to run.
    """
    num_ranks = max(stage_to_rank) + 1
    stages = [
        _Stage(index=s, rank=r, micro_batches=[mb for mb, (a, b) in enumerate(spans) if a <= s <= b])
        for s, r in enumerate(stage_to_rank)
    ]
    by_rank = [[st for st in stages if st.rank == r] for r in range(num_ranks)]
    rank_cap = list(rank_limit) if rank_limit is not None else [float("inf")] * num_ranks
    held = [0] * num_ranks
    free_at = [0.0] * num_ranks
    end: dict[tuple[int, Kind, int], float] = {}
    backward = Kind.B if split_backward else Kind.BW
    orders: list[list[Action]] = [[] for _ in range(num_ranks)]
    remaining = sum(len(st.micro_batches) for st in stages) * (3 if split_backward else 2)

    def backward_ready(st: _Stage) -> float | None:
        if st.next_b >= min(st.next_f, len(st.micro_batches)):
            return None
        mb = st.micro_batches[st.next_b]
        if st.index == spans[mb][1]:
            return end[(st.index, Kind.F, mb)]
        return end.get((st.index + 1, backward, mb))

    def forward_ready(st: _Stage) -> float | None:
        if st.next_f >= len(st.micro_batches) or st.next_f - st.next_b >= stage_limit[st.index]:
            return None
        if held[st.rank] + 1 > rank_cap[st.rank]:
            return None
        mb = st.micro_batches[st.next_f]
        return 0.0 if st.index == spans[mb][0] else end.get((st.index - 1, Kind.F, mb))

    def choose(rank: int) -> tuple[float, Kind, _Stage] | None:
        now = free_at[rank]
        options: list[tuple[float, int, int, Kind, _Stage]] = []
        for st in by_rank[rank]:
            ready = backward_ready(st)
            if ready is not None:
                options.append((max(now, ready), 0, st.micro_batches[st.next_b], backward, st))
            ready = forward_ready(st)
            if ready is not None:
                options.append((max(now, ready), 1, st.micro_batches[st.next_f], Kind.F, st))
        options.sort(key=lambda o: o[:3])
        if options and options[0][0] <= now:
            return now, options[0][3], options[0][4]
        waiting_w = [st for st in by_rank[rank] if st.pending_w]
        if waiting_w:
            return now, Kind.W, min(waiting_w, key=lambda st: st.index)
        return (options[0][0], options[0][3], options[0][4]) if options else None

    while remaining:
        picks = [(pick, rank) for rank in range(num_ranks) if (pick := choose(rank)) is not None]
        if not picks:
            raise ValueError(
                "the activation limits leave no action able to run; raise memory_limit "
                f"(stage limits {list(stage_limit)}, rank limits {rank_cap})"
            )
        (start, kind, st), rank = min(picks, key=lambda p: (p[0][0], p[1]))
        f_cost, b_cost, w_cost = costs[st.index]
        if kind is Kind.F:
            mb = st.micro_batches[st.next_f]
            st.next_f += 1
            held[rank] += 1
            duration = f_cost
        elif kind is Kind.W:
            mb = st.pending_w.popleft()
            held[rank] -= 1
            duration = w_cost
        else:
            mb = st.micro_batches[st.next_b]
            st.next_b += 1
            if split_backward:
                st.pending_w.append(mb)
                duration = b_cost
            else:
                held[rank] -= 1
                duration = b_cost + w_cost
        free_at[rank] = start + duration
        end[(st.index, kind, mb)] = free_at[rank]
        orders[rank].append(Action(st.index, kind, mb))
        remaining -= 1
    return orders


def check_costs(costs: Sequence[Sequence[float]] | None, num_stages: int) -> list[StageCost]:
    """Per-stage (F, B, W) times; unit times when None."""
    if costs is None:
        return [(1.0, 1.0, 1.0)] * num_stages
    if len(costs) != num_stages:
        raise ValueError(f"stage_costs needs one (F, B, W) triple per stage ({num_stages}), got {len(costs)}")
    out = []
    for s, triple in enumerate(costs):
        if len(triple) != 3 or any(t < 0 for t in triple):
            raise ValueError(f"stage_costs[{s}] must be three times >= 0 (F, B, W), got {tuple(triple)}")
        out.append((float(triple[0]), float(triple[1]), float(triple[2])))
    return out


def check_limits(limit: Sequence[int] | None, default: Sequence[int], name: str) -> list[int]:
    if limit is None:
        return list(default)
    if len(limit) != len(default) or any(int(x) < 1 for x in limit):
        raise ValueError(f"{name} needs {len(default)} integers >= 1, got {tuple(limit)}")
    return [int(x) for x in limit]
