"""The bottleneck sweep (Alpa/HARP's): the layer split minimising the slowest stage.

:func:`bottleneck_split` searches the bottleneck time t by bisection; each probe gives every
stage in turn the most layers within t and its memory (a greedy, optimal for contiguous splits
with monotone costs), and when that fails a dynamic program over the reachable cuts decides.

:class:`StageEnds` is the planner's ``stage_end(s, i, t)`` for one setting
(:func:`medley.search.rules.split_rules.bottleneck`): the largest end j such that stage s holding layers
i..j-1 fits the time budget t on every device type that runs it (a type running c micro-batches
per step has t / c) and, under at least one memory option of a given set, the memory of every
such type; i when not even one layer fits. The sweep asks it about a million times in a
1,024-device search, so it is arranged for that. Memory does not depend on the budget: under each
option the memory allows ends up to a limit, and a streamed ZeRO-3 option has two, one for ends
short of its bucket count (such stages gather a larger share of their weights, checked exactly)
and one for the rest. Options of one recompute flag share their time prefix, and the end under
the best option is ``min(T, best limit)``, T the end the time budget allows. So per stage the
limits of every start are worked out once (:meth:`StageEnds.limits`; their memory side once per
search, :class:`MemoryLimits`), and a probe costs one bisection per device type and recompute flag.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from medley.search.estimate.bounds import stage_memory
from medley.search.rules.builder import Setting
from medley.search.space import MemoryOption


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLimits:
    """The memory side of ``stage_end`` for one stage under the options of one recompute flag, by
    first layer i. It depends on the stage's device types, tp, in-flight micro-batches, the
    structure's dp, micro-batch size and dtype, not on the time budget or the micro-batch counts,
    so every sweep of a search shares it (:attr:`medley.search.estimate.context.PlanContext.sweep_memory`).

    Attributes:
        plain: by i, the largest memory end of the flag's options that do not stream (-1: none).
        streams: (option, buckets, memory end by i) of each streamed ZeRO-3 option of the flag;
            from i, an end short of i + buckets takes the exact check's
            (:meth:`StageEnds.short_end`).
        loose: by i, the largest memory end of any option of the flag, short streamed stages
            unchecked (what :meth:`StageEnds.upper` takes).
        shorts: the exact check's ends found so far, by (buckets, i) of a streamed option.
    """

    plain: list[int]
    streams: tuple[tuple[MemoryOption, int, list[int]], ...]
    loose: list[int]
    shorts: dict[tuple[int, int], int]


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagLimits:
    """What ``stage_end`` needs of one stage under the options of one recompute flag.

    Attributes:
        times: (time prefix, micro-batches) of each device type of the stage, with or without
            recomputation as the flag says.
        memory: the flag's memory limits (:class:`MemoryLimits`).
    """

    times: tuple[tuple[Sequence[float], int], ...]
    memory: MemoryLimits


class StageEnds:
    """``stage_end(s, i, t)`` of :func:`bottleneck_split` for ``setting`` under the memory
    ``options`` (a part of the setting's ladder), with each stage's limits cached: the time side
    here, the memory side in the context for every sweep alike."""

    def __init__(self, setting: Setting, options: Sequence[MemoryOption]) -> None:
        ctx, st = setting.ctx, setting.structure
        self._setting = setting
        self._options = tuple(options)
        self._num_layers = ctx.model.num_layers
        self._stage_types = [setting.stage_types(s) for s in range(st.pp)]
        self._types = [tuple(t for t, _ in pairs) for pairs in self._stage_types]
        self._tables = [[setting.table(s, t) for t, _ in pairs] for s, pairs in enumerate(self._stage_types)]
        self._capacities = [[ctx.type_capacity(t) for t, _ in pairs] for pairs in self._stage_types]
        self._limits: list[tuple[FlagLimits, ...] | None] = [None] * st.pp
        # The options of each recompute flag (in order of first appearance), with their index and
        # the options' fields (what keys the flag's memory limits in the context).
        flags = dict.fromkeys(o.recompute for o in self._options)
        self._by_flag: list[tuple[bool, list[tuple[int, MemoryOption]], tuple]] = []
        for flag in flags:
            members = [(o, option) for o, option in enumerate(self._options) if option.recompute == flag]
            fields = tuple((option.level, option.recompute, option.buckets) for _, option in members)
            self._by_flag.append((flag, members, fields))

    def __call__(self, s: int, i: int, t: float) -> int:
        flags = self._limits[s] or self.limits(s)
        best = i
        for flag in flags:
            end = self._num_layers  # the end the time budget allows on every type
            for times, c in flag.times:
                e = bisect_right(times, times[i] + t / c) - 1
                if e < end:
                    end = e
            memory = flag.memory
            plain = memory.plain[i]
            if plain < end:  # plain memory limits it: a streamed option may go further
                for option, buckets, ends in memory.streams:
                    memory_end, threshold = ends[i], i + buckets
                    if end >= threshold and memory_end >= threshold:
                        e = min(end, memory_end)
                    else:
                        e = min(end, self.short_end(s, memory, option, i, memory_end))
                    if e > plain:
                        plain = e
                end = plain
            if end > best:
                best = end
        return best

    def upper(self, s: int, i: int, t: float) -> int:
        """A bound on ``self(s, i, t)`` that never decreases with i (as the time and memory
        prefixes do not): the exact check of short streamed stages left out, which only lowers
        ends. :func:`bottleneck_split`'s ``upper_end``."""
        flags = self._limits[s] or self.limits(s)
        best = i
        for flag in flags:
            end = flag.memory.loose[i]
            for times, c in flag.times:
                e = bisect_right(times, times[i] + t / c) - 1
                if e < end:
                    end = e
            if end > best:
                best = end
        return best

    def limits(self, s: int) -> tuple[FlagLimits, ...]:
        """Stage s's limits per recompute flag among the options. Under a plain option the end
        is min(T, its memory end), T the end the time allows; under a streamed one it is
        min(T, memory end) when both reach i + buckets, and min(T, ``short``) otherwise
        (:meth:`short_end`); the best option's end counts."""
        setting, st = self._setting, self._setting.structure
        flight = setting.flights[s]
        stage_key = (self._types[s], st.micro_batch_size, setting.dtype, setting.stage_tp(s), st.zero_dp,
                     flight.full, flight.after_b)
        cache = setting.ctx.sweep_memory
        out = []
        for flag, members, fields in self._by_flag:
            times = tuple([(table.total_rc if flag else table.total, c)
                           for table, (_, c) in zip(self._tables[s], self._stage_types[s], strict=True)])
            key = (stage_key, fields)
            memory = cache.get(key)
            if memory is None:
                memory = cache[key] = self.memory_limits(s, members)
            out.append(FlagLimits(times=times, memory=memory))
        self._limits[s] = tuple(out)
        return self._limits[s]

    def memory_limits(self, s: int, members: list[tuple[int, MemoryOption]]) -> MemoryLimits:
        """Stage s's :class:`MemoryLimits` under ``members`` (index in the options, option)."""
        plain_ends = loose_ends = None
        streams = []
        for o, option in members:  # elementwise maxima, taken pairwise
            ends = self.memory_ends(s, o)
            loose_ends = ends if loose_ends is None else np.maximum(loose_ends, ends)
            if option.streams:
                streams.append((option, option.buckets, ends.tolist()))
            else:
                plain_ends = ends if plain_ends is None else np.maximum(plain_ends, ends)
        plain = plain_ends.tolist() if plain_ends is not None else [-1] * (self._num_layers + 1)
        assert loose_ends is not None
        return MemoryLimits(plain=plain, streams=tuple(streams), loose=loose_ends.tolist(), shorts={})

    def memory_ends(self, s: int, o: int) -> np.ndarray:
        """By first layer i, the largest end the memory prefixes allow under option o on every
        type of stage s."""
        setting, st = self._setting, self._setting.structure
        return setting.ctx.memory_ends(self._types[s], st.micro_batch_size, setting.dtype, self._options[o],
                                       st.zero_dp, setting.flights[s], setting.stage_tp(s))

    def short_end(self, s: int, memory: MemoryLimits, option: MemoryOption, i: int, memory_end: int) -> int:
        """The largest end below i + buckets (and up to ``memory_end``) that the exact check
        allows under streamed ``option`` from layer i, every type of stage s in turn (short
        streamed stages gather a larger share of their weights than the prefix counts); kept in
        ``memory.shorts``."""
        short = memory.shorts.get((option.buckets, i))
        if short is None:
            flight, dp = self._setting.flights[s], self._setting.structure.zero_dp
            short = min(memory_end, i + option.buckets - 1)
            for table, capacity in zip(self._tables[s], self._capacities[s], strict=True):
                while short > i and stage_memory(table, i, short, option=option, dp=dp,
                                                 in_flight=flight) > capacity:
                    short -= 1
            memory.shorts[(option.buckets, i)] = short
        return short


def _reachable(
    intervals: list[tuple[int, int]],
    s: int,
    t: float,
    limit: int,
    stage_end: Callable[[int, int, float], int],
) -> list[tuple[int, int]]:
    """End positions stage s can reach from any start in ``intervals`` (disjoint, sorted) within t.

    From start i the reachable ends are i+1..end(i), and end(i) never decreases with i (a later
    start has the same budget for fewer layers), so one interval of starts yields few intervals of
    ends: grow each from its first feasible start through the starts it covers."""
    out: list[tuple[int, int]] = []
    for a, b in intervals:
        i = a
        while i <= b:
            end = min(stage_end(s, i, t), limit)
            if end <= i:  # layer i alone does not fit this stage
                i += 1
                continue
            first = i + 1
            while True:
                k = min(b, end)
                grown = min(stage_end(s, k, t), limit) if k > i else end
                if grown <= end:
                    break
                end = grown
            if out and first <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((first, end))
            i = end + 1
    return out


def bottleneck_split(
    num_layers: int,
    num_stages: int,
    stage_end: Callable[[int, int, float], int],
    *,
    lo: float,
    hi: float,
    iterations: int = 24,
    fallback_hi: float | None = None,
    upper_end: Callable[[int, int, float], int] | None = None,
) -> tuple[tuple[int, ...], float] | None:
    """Contiguous split of ``num_layers`` over ``num_stages`` minimising the bottleneck time.

    ``stage_end(s, i, t)`` is the largest end j such that stage s holding layers i..j-1 fits the
    budget t (time and memory); i when not even one layer fits. Each probe of t is a dynamic
    program over the reachable cut positions (exact for unlike stages, where the greedy
    "fill each stage" is not). Returns (layers per stage, t) or None when no budget up to ``hi``
    admits a split.

    ``upper_end`` (optional) is a bound ``upper_end(s, i, t) >= stage_end(s, i, t)`` that never
    decreases with i. A probe the greedy cannot satisfy first runs the greedy with the bound: as
    every cut the program reaches after stage s lies at or before that greedy's, a bound greedy
    that falls short of the last layer proves the probe infeasible without the program (the
    answer is the same; only the work is saved).
    """

    def bound_reaches(t: float) -> bool:
        """Whether the greedy with ``upper_end`` reaches the last layer (if not, nothing does)."""
        assert upper_end is not None
        start = 0
        for s in range(num_stages):
            start = min(upper_end(s, start, t), num_layers - (num_stages - s - 1))
        return start == num_layers

    def greedy(t: float) -> tuple[int, ...] | None:
        """Each stage takes the most layers it can: often feasible, never wrong when it is."""
        start, split = 0, []
        for s in range(num_stages):
            end = min(stage_end(s, start, t), num_layers - (num_stages - s - 1))
            if end <= start:
                return None
            split.append(end - start)
            start = end
        return tuple(split) if start == num_layers else None

    def probe(t: float) -> tuple[int, ...] | None:
        quick = greedy(t)
        if quick is not None:
            return quick
        if upper_end is not None and not bound_reaches(t):
            return None
        reach = [[(0, 0)]]
        for s in range(num_stages):
            step = _reachable(reach[-1], s, t, num_layers - (num_stages - s - 1), stage_end)
            if not step:
                return None
            reach.append(step)
        if reach[-1][-1][1] != num_layers:
            return None
        # Walk back: each stage starts at the latest reachable cut that can still reach its end.
        split, end = [], num_layers
        for s in range(num_stages - 1, -1, -1):
            start = next(
                i
                for a, b in reversed(reach[s])
                for i in range(min(b, end - 1), a - 1, -1)
                if stage_end(s, i, t) >= end
            )
            split.append(end - start)
            end = start
        return tuple(reversed(split))

    best = probe(hi)
    if best is None and fallback_hi is not None and fallback_hi > hi:
        lo, hi = hi, fallback_hi  # the first guess was too tight
        best = probe(hi)
    if best is None:
        return None
    best_t = hi
    for _ in range(iterations):
        mid = (lo + hi) / 2
        got = probe(mid)
        if got is None:
            lo = mid
        else:
            hi, best, best_t = mid, got, mid
        if hi - lo <= 5e-3 * hi:
            break
    return best, best_t
