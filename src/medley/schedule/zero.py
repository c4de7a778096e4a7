"""ZIPPer's collective placement: ZeRO inside each pipeline stage, its collectives put where the
pipeline idles.

Every stage is its own ZeRO group: the devices that run that stage in each of the ``dp``
replicas. The pass inserts, per stage and in every replica's program:

* ``UNSHARD(s, b)``: all-gather of bucket ``b``'s weights (level 3 only), and ``RESHARD(s, b)``
  after its last use in the window;
* ``REDUCE_GRAD(s, b)``: the gradient reduction of bucket ``b`` (all-reduce at level 0,
  reduce-scatter at 1-3) after its last weight gradient of the window;
* ``CLIP`` (with gradient clipping): one all-reduce of the squared gradient norm over every
  rank, after which each rank clips and runs its optimizer steps;
* ``OPTIM(s, b)``: the (sharded) optimizer step of bucket ``b``; at levels 1-2 each member
  updated only its shard, so an ``UNSHARD(s, b)`` after it gathers the updated weights (with the
  reduce-scatter, the same 2Ψ traffic as level 0's all-reduce).

Two policies. ``naive`` is what a plain FSDP wrapper does: level 3 gathers the whole stage before
every forward and every backward and frees it after; one reduction and the optimizer step after
the stage's last backward. ``bubble`` is the ZIPPer idea: the stage is split into layer buckets
so that bucket k's gather overlaps bucket k-1's compute; weights stay gathered across a window of
micro-batches (``gather_windows`` per step, 1 = the whole step) so the gathers land in the
stage's head bubble; each bucket's reduction starts as soon as its last weight gradient of the
window is done (the backward walks buckets last to first), which lands it in the tail bubble or,
for zero-bubble schedules, right after the deferred W that fills that bubble.

Every member of a DP group issues the same collectives in the same order even when replicas run
different numbers of micro-batches: windows are counted per step, not per micro-batch, and a
replica with fewer micro-batches pads the naive policy's per-micro-batch gathers.

The settings are :mod:`medley.schedule.zero_settings`; the rules a placed schedule must keep,
:mod:`medley.schedule.zero_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from medley.cost.zero_levels import zero_level
from medley.schedule.ir import COLLECTIVE_KINDS, COMPUTE_KINDS, Action, Kind, PipelineSchedule
from medley.schedule.zero_checks import CollectiveMismatchError, check_dp_consistency
from medley.schedule.zero_settings import Placement, StageZero


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` items into ``parts`` contiguous groups, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def bucket_layers(stage_layers: Sequence[int], zero: Sequence[StageZero], policy: Placement) -> dict:
    """Layers per bucket for every stage (one bucket under the naive policy)."""
    out: dict[int, tuple[int, ...]] = {}
    for stage, (layers, setting) in enumerate(zip(stage_layers, zero, strict=True)):
        count = 1 if policy is Placement.NAIVE else max(1, min(setting.buckets, layers))
        out[stage] = tuple(split_evenly(layers, count))
    return out


def _windows(items: list[int], count: int) -> list[list[int]]:
    sizes = split_evenly(len(items), count)
    out, start = [], 0
    for size in sizes:
        out.append(items[start : start + size])
        start += size
    return out


Placed = list[tuple[int, Action]]
"""Collectives with their slot in a rank's compute list: ``2i`` before compute ``i``, ``2i+1`` after."""


def _stage_collectives(
    row: list[Action], stage: int, setting: StageZero, nbuckets: int, policy: Placement, naive_rounds: int,
    *, same_rounds: bool = False,
) -> Placed:
    """Collectives of ``stage`` on one rank, in issue order, with their natural slots.

    The stage's sequence must not depend on the replica's micro-batch count, so there is one
    window structure per stage: level-3 gather rounds under the bubble policy (each round ends
    with its gradient reduction), reduction windows at levels 0-2. Under the naive policy a
    replica with fewer compute actions pads its gathers to ``naive_rounds``. ``same_rounds``: every
    replica runs the same kinds of compute action on this stage in the same order, so streamed
    ZeRO-3 reduces only after the actions that make weight gradients (W, BW) and never pads;
    otherwise it reduces after every action, keeping each round alike.
    """
    uses = [i for i, a in enumerate(row) if a.stage == stage and a.kind in COMPUTE_KINDS]
    grads = [i for i in uses if row[i].kind is Kind.W or row[i].kind is Kind.BW]
    buckets: list[int | None] = [None] if nbuckets == 1 else list(range(nbuckets))
    reduce_order = list(reversed(buckets))  # the backward finishes the last bucket first
    gathers = [Action(stage, Kind.UNSHARD, bucket=b) for b in buckets]
    frees = [Action(stage, Kind.RESHARD, bucket=b) for b in buckets]
    reduces = [Action(stage, Kind.REDUCE_GRAD, bucket=b) for b in reduce_order]
    end = 2 * grads[-1] + 1
    out: Placed = []
    streams = setting.streams and policy is Placement.BUBBLE
    level3 = zero_level(setting.level).gathers_for_compute
    if level3 and (policy is Placement.NAIVE or streams):
        # One gather round per compute action, FSDP-style; streaming also reduces as it goes.
        after_use = frees + reduces if streams else frees
        for i in uses:
            after = frees if same_rounds and streams and i not in grads else after_use
            out += [(2 * i, a) for a in gathers] + [(2 * i + 1, a) for a in after]
        out += [(end, a) for _ in range(naive_rounds - len(uses)) for a in gathers + after_use]
        if not streams:
            out += [(end, a) for a in reduces]
    elif level3:
        last = 2 * uses[0] + 1
        for window in _windows(uses, setting.gather_windows):
            if window:
                out += [(2 * window[0], a) for a in gathers]
                last = 2 * window[-1] + 1
                out += [(last, a) for a in frees + reduces]
            else:  # fewer uses than rounds: an empty round keeps the DP group's sequence equal
                out += [(last, a) for a in gathers + frees + reduces]
    else:
        windowed = zero_level(setting.level).gradient_windows and policy is Placement.BUBBLE
        windows = setting.grad_windows if windowed else 1
        last = 2 * grads[0] + 1
        for window in _windows(grads, windows):
            last = 2 * window[-1] + 1 if window else last
            out += [(last, a) for a in reduces]
    out += [(end, Action(stage, Kind.OPTIM, bucket=b)) for b in reduce_order]
    if zero_level(setting.level).gathers_after_step:
        # Each member updated only its shard: gather the updated weights (ZeRO-1/2 param sync).
        out += [(end, Action(stage, Kind.UNSHARD, bucket=b)) for b in reduce_order]
    return out


def _common_order(chains: list[list[Placed]], pinned: Callable[[Action], bool]) -> list[tuple[int, int]]:
    """One issue order of a rank's collectives that every replica can follow.

    ``chains[r][k]`` is replica r's natural (slot, action) list for the k-th stage of the rank;
    the actions match across replicas, the slots differ. Each stage's chain keeps its order. A
    gather cannot move later than its slot (compute needs it) but may move earlier; everything
    else may move later. So a non-gather goes next only if, in every replica, no gather still
    waiting has an earlier slot. Returns (stage chain, index in chain) pairs.
    """
    heads = [0] * len(chains[0])
    waiting = [
        sorted((slot, k, i) for k, c in enumerate(r) for i, (slot, a) in enumerate(c) if pinned(a))
        for r in chains
    ]
    order: list[tuple[int, int]] = []
    total = sum(len(c) for c in chains[0])
    while len(order) < total:
        candidates = []
        for k, head in enumerate(heads):
            if head == len(chains[0][k]):
                continue
            action = chains[0][k][head][1]
            allowed = pinned(action) or all(
                not w or r[k][head][0] <= w[0][0] for r, w in zip(chains, waiting, strict=True)
            )
            if allowed:
                candidates.append((chains[0][k][head][0], k))
        if not candidates:
            raise CollectiveMismatchError(
                "no common collective order exists for this rank's stages across replicas; "
                "use gather_windows=1 or equal micro-batch counts"
            )
        _, k = min(candidates)
        if pinned(chains[0][k][heads[k]][1]):
            for r, w in zip(chains, waiting, strict=True):
                w.remove((r[k][heads[k]][0], k, heads[k]))
        order.append((k, heads[k]))
        heads[k] += 1
    return order


def _positions(
    chain_lists: list[Placed], order: list[tuple[int, int]], pinned: Callable[[Action], bool]
) -> Placed:
    """Slots for one replica following ``order``: others at their slot or later, gathers right
    after the previous collective (never later than their own slot, by construction)."""
    placed: Placed = []
    previous = 0
    for k, i in order:
        slot, action = chain_lists[k][i]
        if not pinned(action):
            previous = max(previous, slot)
        placed.append((previous, action))
    return placed


def place_collectives(
    schedules: Sequence[PipelineSchedule],
    zero: Sequence[StageZero],
    *,
    stage_layers: Sequence[int],
    policy: Placement | str = Placement.BUBBLE,
    clip_grad: bool = False,
    buckets: Mapping[int, tuple[int, ...]] | None = None,
    rounds: Sequence[int] | None = None,
    alike: Sequence[bool] | None = None,
) -> list[PipelineSchedule]:
    """Insert the ZeRO collectives of every stage into every replica's schedule.

    ``schedules`` are the replicas' programs (compute-only or lowered; same stages and
    stage-to-rank map, micro-batch counts may differ). ``zero[s]`` and ``stage_layers[s]`` are
    per global stage. Existing collectives are removed first, so the pass can be re-run. The
    replica with the most compute sets the issue order every other member of a DP group follows.
    With ``clip_grad`` every rank's optimizer steps wait behind one ``CLIP`` (the world-wide
    gradient-norm all-reduce), issued after the rank's last other action.

    When a stage's DP group reaches beyond these replicas (replica groups of their own shape,
    :mod:`medley.plan.segments`), the caller says what the whole group shares: ``buckets`` (layers
    per bucket of each stage; default :func:`bucket_layers`), ``rounds`` (per stage, the compute
    actions a ZeRO-3 gather per action pads to; default the most of these replicas) and ``alike``
    (per stage, whether every member runs the same kinds of compute in the same order).
    """
    policy = Placement(policy)
    first = schedules[0]
    if len(zero) != first.num_stages or len(stage_layers) != first.num_stages:
        raise ValueError(
            f"need one ZeRO setting and one layer count per stage ({first.num_stages}), "
            f"got {len(zero)} and {len(stage_layers)}"
        )
    if any(s.stage_to_rank != first.stage_to_rank for s in schedules):
        raise ValueError("all replicas must place stages on pipeline ranks the same way")
    _check_per_use_gathers(schedules, zero, policy)
    if buckets is None:
        buckets = bucket_layers(stage_layers, zero, policy)
    elif any(sum(buckets[s]) != stage_layers[s] or min(buckets[s]) < 1 for s in range(first.num_stages)):
        raise ValueError(f"bucket layers {dict(buckets)} do not cut the stages' layers {tuple(stage_layers)}")
    # Replicas of one micro-batch count usually share their program object: place its
    # collectives once (the placement of a replica depends only on its program and the order).
    by_id = {id(s): s for s in schedules}  # in order of first appearance
    distinct = list(by_id.values())
    position = {key: j for j, key in enumerate(by_id)}
    which = [position[id(s)] for s in schedules]
    bases = [[[a for a in row if a.kind not in COLLECTIVE_KINDS] for row in s.actions] for s in distinct]
    kinds = [_kinds_by_stage(b, first.num_stages) for b in bases]
    uses = list(rounds) if rounds is not None else [max(len(k[s]) for k in kinds)
                                                     for s in range(first.num_stages)]
    reference = which[max(range(len(schedules)), key=lambda r: (sum(map(len, bases[which[r]])), -r))]
    same_rounds = list(alike) if alike is not None else [len({tuple(k[s]) for k in kinds}) == 1
                                                         for s in range(first.num_stages)]

    def pinned(action: Action) -> bool:  # a ZeRO-3 gather: compute waits for it, it cannot be late
        return action.kind is Kind.UNSHARD and zero_level(zero[action.stage].level).gathers_for_compute

    placed: list[list[list[Action]]] = [[] for _ in distinct]
    for rank in range(first.num_ranks):
        chains = [
            [
                _stage_collectives(base[rank], stage, zero[stage], len(buckets[stage]), policy, uses[stage],
                                   same_rounds=same_rounds[stage])
                for stage in first.stages_of_rank(rank)
            ]
            for base in bases
        ]
        # Identical replicas add nothing to the common order: each must allow a move, and a copy
        # allows exactly what its original does.
        order = _common_order([chains[reference]] + chains[:reference] + chains[reference + 1 :], pinned)
        for j, base in enumerate(bases):
            row = _merge(base[rank], _positions(chains[j], order, pinned))
            placed[j].append(_behind_clip(row, first.stages_of_rank(rank)[0]) if clip_grad else row)
    rows = [[list(row) for row in placed[j]] for j in which]
    out = []
    for sched, sched_rows in zip(schedules, rows, strict=True):
        placed_sched = sched.with_actions(sched_rows)
        placed_sched.bucket_layers = dict(buckets)
        out.append(placed_sched)
    check_dp_consistency(out)
    return out


def _kinds_by_stage(rows: list[list[Action]], num_stages: int) -> list[list[Kind]]:
    """The kinds of each stage's actions, rank by rank in program order (stages past the last
    are left to the validator)."""
    out: list[list[Kind]] = [[] for _ in range(num_stages)]
    for row in rows:
        for a in row:
            if a.stage < num_stages:
                out[a.stage].append(a.kind)
    return out


def _check_per_use_gathers(
    schedules: Sequence[PipelineSchedule], zero: Sequence[StageZero], policy: Placement
) -> None:
    """Refuse ZeRO-3 gathers per compute action (naive policy, or streamed) on a rank that holds
    several stages when replicas run different micro-batch counts: the replica with fewer pads its
    gather rounds at the end of its program, out of step with the other stages' transfers of its
    own pipeline, which can deadlock (seen with interleaved 1F1B)."""
    counts = {s.num_micro_batches for s in schedules}
    first = schedules[0]
    if len(counts) == 1 or all(len(first.stages_of_rank(r)) == 1 for r in range(first.num_ranks)):
        return
    for stage, setting in enumerate(zero):
        meaning = zero_level(setting.level)
        if meaning.gathers_for_compute and (policy is Placement.NAIVE or setting.streams):
            raise CollectiveMismatchError(
                f"stage {stage} gathers its ZeRO-3 weights per micro-batch (naive placement or "
                f"gather_windows=0) on a rank that holds several stages, and replicas run "
                f"{sorted(counts)} micro-batches; use gather_windows >= 1 with the bubble placement, "
                "or equal micro-batch counts")


def _behind_clip(row: list[Action], stage: int) -> list[Action]:
    """Move the optimizer steps (and the ZeRO-1/2 weight gathers that follow them) behind a CLIP:
    the global norm needs every gradient, so no step may start before it."""
    stepped: set[tuple[int, int | None]] = set()
    kept: list[Action] = []
    steps: list[Action] = []
    optim, unshard = Kind.OPTIM, Kind.UNSHARD
    for action in row:
        kind = action.kind
        if kind is optim:
            stepped.add((action.stage, action.bucket))
            steps.append(action)
        elif kind is unshard and (action.stage, action.bucket) in stepped:
            steps.append(action)
        else:
            kept.append(action)
    return [*kept, Action(stage, Kind.CLIP), *steps]


def _merge(base: list[Action], items: Placed) -> list[Action]:
    """``base`` with each item at its slot (``2i``: before ``base[i]``, ``2i+1``: after it; items
    of one slot in their order; slots past the end are dropped)."""
    by_slot: dict[int, list[Action]] = {}
    for slot, action in items:
        by_slot.setdefault(slot, []).append(action)
    merged: list[Action] = []
    done = 0  # base[:done] is in merged
    for slot in sorted(by_slot):
        if slot >= 2 * len(base):
            break
        cut = slot // 2 + slot % 2
        merged.extend(base[done:cut])
        merged.extend(by_slot[slot])
        done = cut
    merged.extend(base[done:])
    return merged
