"""A quick lower bound on a structure's 1F1B step, by which the search orders and skips structures
before it estimates them (:func:`medley.plan.search.structure_bound`'s caller, ``_estimate``).

The bound relaxes the layer split to fractions of the model: rank k holding a fraction f of it
takes f x its whole-model time. A replica running m micro-batches with stage times t_k takes at
least (m - 1) x max t_k + sum t_k (1F1B's steady state and fill, as
:func:`medley.plan.bounds.pipeline_time` estimates it; transfers, DP collectives and layer
granularity only add). Two lower bounds follow, and the larger counts:

* :func:`fill_bound`: no recomputation, the fill of the best set of ranks;
* :func:`recompute_bound`: a rank that cannot hold more than a fraction g_k of the model without
  recomputation (its roomiest contiguous run under the most frugal plain option, with 1F1B's
  micro-batches in flight at its position) takes its recomputing time beyond g_k.

Both hold for every family the search ranks structures by (1F1B) and were checked against the
estimate over every structure of the bench's 16- and 64-device cases
(``tests/plan/test_structure_bound.py`` keeps a sample).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from medley.plan.bounds import Flight, memory_options, memory_prefix
from medley.plan.context import PlanContext
from medley.plan.space import Structure

Rank = tuple[float, float, float, float]
"""(whole-model seconds, the same recomputing, the fraction of the model a rank holds at most
without recomputing, and with)."""


def structure_bound(ctx: PlanContext, st: Structure) -> float:
    """:class:`StructureBounds`' bound of one structure (a search keeps one instance for all)."""
    return StructureBounds(ctx)(st)


class StructureBounds:
    """A lower bound on a structure's 1F1B step estimate (see the module docstring), with the
    figures of each kind of rank kept across the structures of a search."""

    def __init__(self, ctx: PlanContext) -> None:
        self._ctx = ctx
        self._ranks: dict[tuple[str, int, int, str, int, int], Rank] = {}
        self._times: dict[tuple[str, int, int], tuple[float, float, float, float]] = {}
        self._blocks: dict[tuple, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}

    def __call__(self, st: Structure) -> float:
        """Infinite when a replica's ranks cannot hold the model between them. A TP group counts
        as one rank at its degree's speed and memory (:meth:`PlanContext.table`, all-reduces
        included)."""
        ctx, mbs = self._ctx, st.micro_batch_size
        tps = tuple(st.tp_of(k) for k in range(st.pp))
        kinds = Counter(tuple(map(ctx.type_names.__getitem__, row)) for row in st.assignment)
        dtype = ctx.dtype(st.assignment)
        micro_batches = ctx.global_batch // mbs
        # 1F1B's warm-up depths at the most micro-batches any replica runs (at least the mean).
        flights = [min(st.pp - k, -(-micro_batches // st.dp)) for k in range(st.pp)]
        rows: Counter[tuple[Rank, ...]] = Counter()
        for types, n in kinds.items():
            rows[tuple(self._rank(t, tp, mbs, dtype, st.dp, flight)
                       for t, tp, flight in zip(types, tps, flights, strict=True))] += n
        return max(fill_bound(rows, micro_batches), recompute_bound(rows, micro_batches))

    def _rank(self, device_type: str, tp: int, mbs: int, dtype: str, dp: int, flight: int) -> Rank:
        """A rank's whole-model seconds without and with recomputation, and the fractions of the
        model's time no contiguous run of layers exceeds that it holds with ``flight``
        micro-batches in flight, without recomputing and with: as many blocks as the least block
        memory allows under the most frugal option, at the longest block's time, plus the
        embedding and head."""
        key = (device_type, tp, mbs, dtype, dp, flight)
        found = self._ranks.get(key)
        if found is None:
            seconds, recomputing, block, others = self._rank_times(device_type, tp, mbs)
            capacity = self._ctx.type_capacity(device_type)
            blocks = self._ctx.model.num_blocks
            plain, most = (
                min(1.0, (min(held, blocks) * block + others) / seconds)
                for held in (max(capacity // (state + flight * act) if state + flight * act > 0 else blocks
                                 for state, act in memory)
                             for memory in self._block_memory(device_type, tp, mbs, dtype, dp))
            )
            found = self._ranks[key] = (seconds, recomputing, plain, most)
        return found

    def _rank_times(self, device_type: str, tp: int, mbs: int) -> tuple[float, float, float, float]:
        """Whole-model seconds without and with recomputation, the longest block's, and the
        embedding's and head's together."""
        key = (device_type, tp, mbs)
        found = self._times.get(key)
        if found is None:
            table = self._ctx.table(device_type, mbs, tp=tp)
            last = table.num_layers
            block = max(table.time(i, i + 1) for i in range(1, last - 1))
            found = self._times[key] = (table.total[-1], table.time(0, last, recompute=True), block,
                                        table.time(0, 1) + table.time(last - 1, last))
        return found

    def _block_memory(
        self, device_type: str, tp: int, mbs: int, dtype: str, dp: int
    ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """Per option, the plain ones and the recomputing ones: the least bytes of state, and of
        activations per micro-batch in flight, that a block adds to a stage (by
        :func:`medley.plan.bounds.memory_prefix`, which leaves out what short and recomputing
        stages hold more)."""
        key = (device_type, tp, mbs, dtype, dp)
        found = self._blocks.get(key)
        if found is None:
            table = self._ctx.table(device_type, mbs, dtype, tp)
            found = ([], [])
            for option in memory_options(dp):
                state = np.diff(memory_prefix(table, option=option, dp=dp, flight=Flight(full=0.0)))[1:-1]
                both = np.diff(memory_prefix(table, option=option, dp=dp, flight=Flight(full=1.0)))[1:-1]
                found[option.recompute].append((float(state.min()), float((both - state).min())))
            self._blocks[key] = found
        return found


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
    speed = fill = 0.0
    longest = 0.0
    replicas = 0
    for row, n in rows.items():
        bottleneck = _least_bottleneck(row)
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
    for seconds, recomputing, plain, most in row:
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
    for seconds, recomputing, plain, most in row:
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
