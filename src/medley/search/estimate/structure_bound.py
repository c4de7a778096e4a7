"""Lower bounds on a structure's 1F1B step estimate, by which the search orders and skips
structures before it builds them (``_estimate`` in :mod:`medley.search.planner`).

The bounds relax the layer split to fractions of the model: rank k holding a fraction f of it
takes f x its whole-model time. A replica running m micro-batches with stage times t_k takes at
least (m - 1) x max t_k + sum t_k (1F1B's steady state and fill, as
:func:`medley.search.estimate.bounds.pipeline_time` estimates it; transfers and DP collectives only add).
Each rank's memory is read at 1F1B's in-flight depth of its position, by the memory prefixes
(which never count more than the exact check). The larger of these counts:

* :func:`fill_bound`: no recomputation, the fill of the best set of ranks;
* :func:`recompute_bound`: a rank takes its recomputing time for the share beyond what it holds
  without recomputing, and holds no more than it can with (infinite when a replica cannot hold
  the model: no build needed to find that); recomputing time is the least any recomputation
  (full, selective, on some blocks) pays per block's worth of activations freed
  (``_least_rerun_rate``);
* :func:`block_bound` (:meth:`StructureBounds.refined`, asked only of structures the others do
  not skip): the same with whole blocks per stage for the bottleneck.

All hold for 1F1B, the family the search ranks structures by; they were checked against the
estimate over every structure of the bench's 16- and 64-device cases, and
``tests/plan/test_structure_bound.py`` checks a sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from heapq import heapify, heappop, heappush

import numpy as np

from medley.cost.zero_memory import state_bytes_per_param
from medley.schedule.generators.classic import one_f_one_b_depth
from medley.search.estimate.bounds import Flight, memory_options, memory_prefix
from medley.search.estimate.context import PlanContext
from medley.search.estimate.layer_table import LayerTable
from medley.search.space import Structure

Rank = tuple[float, float, float, float, float, float, int, int]
"""A rank's whole-model seconds, the same recomputing, the fractions of the model it holds at most
without recomputing and with; its shortest block's seconds, the same recomputing, and the blocks
it holds at most without recomputing and with."""


def structure_bound(ctx: PlanContext, st: Structure) -> float:
    """:class:`StructureBounds`' bound of one structure (a search keeps one instance for all)."""
    return StructureBounds(ctx)(st)


class StructureBounds:
    """A lower bound on a structure's 1F1B step estimate (see the module docstring), with the
    figures of each kind of rank kept across the structures of a search."""

    def __init__(self, ctx: PlanContext) -> None:
        self._ctx = ctx
        self._ranks: dict[tuple[str, int, int, str, int, int], Rank] = {}
        self._times: dict[tuple[str, int, int], tuple[float, ...]] = {}
        self._blocks: dict[tuple, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}

    def __call__(self, st: Structure) -> float:
        """Infinite when a replica's ranks cannot hold the model between them. A TP group counts
        as one rank at its degree's speed and memory (:meth:`PlanContext.table`, all-reduces
        included)."""
        rows, micro_batches = self._rows(st)
        return max(fill_bound(rows, micro_batches), recompute_bound(rows, micro_batches))

    def refined(self, st: Structure) -> float:
        """A bound at least this one's, with whole blocks per stage (:func:`block_bound`): dearer,
        so the search asks for it only of structures its bound does not skip."""
        rows, micro_batches = self._rows(st)
        return max(fill_bound(rows, micro_batches),
                   block_bound(rows, micro_batches, self._ctx.model.num_blocks))

    def _rows(self, st: Structure) -> tuple[Counter[tuple[Rank, ...]], int]:
        """The replicas' ranks (replica ranks: count) and the micro-batches of size
        ``st.micro_batch_size`` in a step."""
        ctx, mbs = self._ctx, st.micro_batch_size
        tps = tuple(st.tp_of(k) for k in range(st.pp))
        kinds = Counter(tuple(map(ctx.type_names.__getitem__, row)) for row in st.assignment)
        dtype = ctx.dtype(st.assignment)
        micro_batches = ctx.global_batch // mbs
        # 1F1B's warm-up depths at the most micro-batches any replica runs (at least the mean).
        flights = [one_f_one_b_depth(st.pp, k, -(-micro_batches // st.dp)) for k in range(st.pp)]
        rows: Counter[tuple[Rank, ...]] = Counter()
        for types, n in kinds.items():
            rows[tuple(self._rank(t, tp, mbs, dtype, st.zero_dp, flight)
                       for t, tp, flight in zip(types, tps, flights, strict=True))] += n
        return rows, micro_batches

    def _rank(self, device_type: str, tp: int, mbs: int, dtype: str, dp: int, flight: int) -> Rank:
        """A rank's whole-model seconds without and with recomputation, and the fractions of the
        model's time no contiguous run of layers exceeds that it holds with ``flight``
        micro-batches in flight, without recomputing and with: as many blocks as the least block
        memory allows under the most frugal option, at the longest block's time, plus the
        embedding and head. Then its shortest block's seconds without and with recomputation and
        those block counts."""
        key = (device_type, tp, mbs, dtype, dp, flight)
        found = self._ranks.get(key)
        if found is None:
            seconds, recomputing, longest, others, block, block_rc = self._rank_times(device_type, tp, mbs)
            capacity = self._ctx.type_capacity(device_type)
            blocks = self._ctx.model.num_blocks
            plain_blocks, most_blocks = (
                min(blocks, int(max(capacity // (state + flight * act) if state + flight * act > 0 else blocks
                                    for state, act in memory)))
                for memory in self._block_memory(device_type, tp, mbs, dtype, dp)
            )
            plain, most = (min(1.0, (held * longest + others) / seconds)
                           for held in (plain_blocks, most_blocks))
            found = self._ranks[key] = (seconds, recomputing, plain, most, block, block_rc, plain_blocks,
                                        most_blocks)
        return found

    def _rank_times(self, device_type: str, tp: int, mbs: int) -> tuple[float, ...]:
        """Whole-model seconds without and with recomputation, the longest block's, the
        embedding's and head's together, and the shortest block's without and with
        recomputation."""
        key = (device_type, tp, mbs)
        found = self._times.get(key)
        if found is None:
            table = self._ctx.table(device_type, mbs, tp=tp)
            last = table.num_layers
            plain = [table.time(i, i + 1) for i in range(1, last - 1)]
            rate = _least_rerun_rate(table)
            recomputing = [table.time(i, i + 1) + rate * (table.refwd[i + 1] - table.refwd[i])
                           for i in range(1, last - 1)]
            found = self._times[key] = (table.total[-1], table.total[-1] + rate * table.refwd[-1], max(plain),
                                        table.time(0, 1) + table.time(last - 1, last), min(plain),
                                        min(recomputing))
        return found

    def _block_memory(
        self, device_type: str, tp: int, mbs: int, dtype: str, dp: int
    ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """Per option, the plain ones and the recomputing ones: the least bytes of state, and of
        activations per micro-batch in flight, that a block adds to a stage (by
        :func:`medley.search.estimate.bounds.memory_prefix`, which leaves out what short and recomputing
        stages hold more)."""
        key = (device_type, tp, mbs, dtype, dp)
        found = self._blocks.get(key)
        if found is None:
            table = self._ctx.table(device_type, mbs, dtype, tp)
            found = ([], [])
            for option in memory_options(dp):
                state = np.diff(memory_prefix(table, option=option, dp=dp, flight=Flight(full=0.0)))[1:-1]
                both = np.diff(memory_prefix(table, option=option, dp=dp, flight=Flight(full=1.0)))[1:-1]
                found[bool(option.recompute)].append((float(state.min()), float((both - state).min())))
            self._blocks[key] = found
        return found


def _least_rerun_rate(table: LayerTable) -> float:
    """The least rerun seconds, per second of a block's forward, that any recomputation pays per
    block's worth of activations it frees: full recomputation reruns at least the blocks it frees
    (rate 1), selective reruns their memory-bound share but frees only what it does not keep, so
    it reruns share x held / (held - kept) blocks' worth per block freed (held: a plain block's
    activations and at most its autocast copies). The recomputing times of
    the bounds take the least of the two, and only blocks rerun."""
    if table.num_layers < 3:
        return 1.0
    # What a plain block holds per micro-batch: its activations and, at most, autocast's weight
    # copies (which a recomputing block does not keep).
    per_param = state_bytes_per_param(table.dtype)
    copies = (per_param.weights if per_param.master_in_optimizer else 0.0) * (table.cast[2] - table.cast[1])
    act, kept = table.act[2] - table.act[1] + copies, table.act_sel[2] - table.act_sel[1]
    forward = table.refwd[2] - table.refwd[1]
    if act <= kept or forward <= 0:
        return 1.0
    share = (table.refwd_sel[2] - table.refwd_sel[1]) / forward
    return min(1.0, share * act / (act - kept))


def fill_bound(rows: Counter[tuple[Rank, ...]], micro_batches: float) -> float:
    """The least step in which replicas of the ``rows`` ranks (replica ranks: count) run
    ``micro_batches`` micro-batches without recomputing. For a set of j ranks sharing the model at
    equal time the replica's step is (m + j - 1) / S_j, S_j their summed speeds, least over the
    sets of the fastest j; so within T a replica runs at most 1 + sum over its ranks faster than T
    of (T / their time - 1): a rank joins once the step exceeds its whole-model time. T is found
    over the ranks' times in order. A replica whose fastest rank is slower than T counts 1 (it
    runs at least one micro-batch, which takes longer than T): more than it can, so the bound
    stays below. At least the steady state alone: micro-batches over the summed speed."""
    counts: Counter[float] = Counter()
    for row, n in rows.items():
        for rank in row:
            counts[rank[0]] += n
    values = sorted(counts)
    base = micro_batches - sum(rows.values())
    rate = active = 0.0
    step = float("inf")
    for i, v in enumerate(values):
        rate += counts[v] / v
        active += counts[v]
        step = (base + active) / rate
        if i + 1 == len(values) or step <= values[i + 1]:
            break
    return max(step, micro_batches / sum(n / v for v, n in counts.items()))


def recompute_bound(rows: Counter[tuple[Rank, ...]], micro_batches: float) -> float:
    """The least step in which the replicas run ``micro_batches`` micro-batches when each rank
    takes its recomputing time for the share of the model beyond what it holds without, and holds
    no more than it can with: rank k holding a fraction f <= c_k takes at least
    h_k(f) = T_k min(f, g_k) + R_k max(0, f - g_k). A replica's step is then at least
    (m - 1) B + F, B the least bottleneck any split allows (:func:`_least_bottleneck`) and F the
    least sum of stage times (:func:`_least_sum`, at least B), so it runs at most
    1 + (T - F) / B micro-batches in T; and every replica runs at least one (T >= F). Infinite
    when a replica's ranks cannot hold the model between them."""
    return _replicas_step(rows, micro_batches)


def block_bound(rows: Counter[tuple[Rank, ...]], micro_batches: float, blocks: int) -> float:
    """:func:`recompute_bound` with each replica's bottleneck at least the least one whole
    blocks allow (:func:`_block_bottleneck`)."""
    return _replicas_step(rows, micro_batches, blocks)


def _replicas_step(rows: Counter[tuple[Rank, ...]], micro_batches: float, blocks: int | None = None) -> float:
    """The least step in which the replicas run ``micro_batches`` micro-batches: one with least
    bottleneck B (by whole ``blocks`` too, if given) and least sum of stage times F runs at most
    1 + (T - F) / B within T (its step is at least (m - 1) B + F, F at least B), and every
    replica runs at least one (T >= F). Infinite when a replica cannot hold the model."""
    speed = fill = longest = 0.0
    replicas = 0
    for row, n in rows.items():
        bottleneck = _least_bottleneck(row)
        if blocks is not None and bottleneck != float("inf"):
            bottleneck = _block_bottleneck(row, blocks, bottleneck)
        if bottleneck == float("inf"):
            return bottleneck
        least = max(_least_sum(row), bottleneck)
        speed += n / bottleneck
        fill += n * least / bottleneck
        longest = max(longest, least)
        replicas += n
    return max((micro_batches - replicas + fill) / speed, longest)


def _least_bottleneck(row: Sequence[Rank]) -> float:
    """The least B for which the ranks' largest fractions within B sum to the whole model: rank
    k's is B / T_k up to g_k, then g_k + (B - T_k g_k) / R_k, at most c_k (a concave, piecewise
    linear sum, walked over its kinks in order); infinite when the c_k sum to less than one."""
    slope, held = 0.0, 0.0  # the sum is slope x B + held between kinks
    kinks: list[tuple[float, float]] = []  # (B, change of slope)
    for seconds, recomputing, plain, most, *_ in row:
        slope += 1.0 / seconds
        plain = min(plain, most)
        kinks.append((seconds * plain, 1.0 / recomputing - 1.0 / seconds))
        kinks.append((seconds * plain + recomputing * (most - plain), -1.0 / recomputing))
    last = 0.0
    for at, change in sorted(kinks):
        if slope > 0.0 and (1.0 - held) / slope <= at:
            return max(last, (1.0 - held) / slope)
        slope += change
        held -= change * at
        last = at
    return last if held >= 1.0 - 1e-9 else float("inf")  # every rank full


def _least_sum(row: Sequence[Rank]) -> float:
    """The least sum of stage times over the splits: the cheapest shares first (each rank's
    plain share at T_k per model, then its recomputing share at R_k)."""
    shares = []
    for seconds, recomputing, plain, most, *_ in row:
        plain = min(plain, most)
        shares += [(seconds, plain), (recomputing, most - plain)]
    left, spent = 1.0, 0.0
    for rate, share in sorted(shares):
        take = min(left, share)
        spent += take * rate
        left -= take
        if left <= 0.0:
            break
    return spent


def _block_bottleneck(row: Sequence[Rank], blocks: int, start: float) -> float:
    """The least B within which the ranks hold ``blocks`` whole blocks between them: a rank holds
    n plain blocks if n <= its plain count and n x its shortest block's time <= B, or n blocks up
    to its recomputing count if, its plain count of them at the plain time and the rest at the
    recomputing time, they take at most B. Walked up from ``start`` over the times at which a rank's count
    grows (the larger of the two then, both lower bounds of the bottleneck); infinite when the
    ranks cannot hold the blocks at all."""
    kinds = Counter(rank[4:] for rank in row)
    if sum(n * max(plain, most) for (_, _, plain, most), n in kinds.items()) < blocks:
        return float("inf")

    def reach(kind: tuple[float, float, int, int], at: float) -> tuple[tuple[int, int], ...]:
        """(blocks within ``at``, cap) plain and recomputing."""
        block, block_rc, plain, most = kind
        n_plain = int(at / block * (1 + 1e-12))
        saved = plain * (block_rc - block)
        n_rc = n_plain if n_plain < plain else max(plain, int((at + saved) / block_rc * (1 + 1e-12)))
        return (n_plain, plain), (n_rc, most)

    def seconds(kind: tuple[float, float, int, int], n: int, recomputing: bool) -> float:
        """n blocks plain, or with all but the plain count recomputing (recomputation may cover
        only some of a stage's blocks)."""
        block, block_rc, plain, _ = kind
        return n * block + (max(0, n - plain) * (block_rc - block) if recomputing else 0.0)

    def held(kind: tuple[float, float, int, int], at: float) -> int:
        return max(min(cap, n) for n, cap in reach(kind, at))

    def after(kind: tuple[float, float, int, int], at: float) -> float:
        return min((seconds(kind, n + 1, rc) for rc, (n, cap) in enumerate(reach(kind, at)) if n < cap),
                   default=float("inf"))

    at = start
    counts = {kind: held(kind, at) for kind in kinds}
    total = sum(kinds[kind] * count for kind, count in counts.items())
    queue = [(after(kind, at), i, kind) for i, kind in enumerate(kinds)]
    heapify(queue)
    while total < blocks:
        at, i, kind = heappop(queue)
        now = held(kind, at)
        total += kinds[kind] * (now - counts[kind])
        counts[kind] = now
        heappush(queue, (after(kind, at), i, kind))
    return at
