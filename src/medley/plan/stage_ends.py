"""The bottleneck sweep's ``stage_end`` for one setting (:func:`medley.plan.split_rules.bottleneck`).

``stage_end(s, i, t)`` is the largest end j such that stage s holding layers i..j-1 fits the time
budget t on every device type that runs it (a type running c micro-batches per step has t / c)
and, under at least one memory option of a given set, the memory of every such type; i when not
even one layer fits.

The sweep asks it about a million times in a 1,024-device search, so it is arranged for that.
Memory does not depend on the budget: under each option the memory allows ends up to a limit, and
a streamed ZeRO-3 option has two, one for ends short of its bucket count (such stages gather a
larger share of their weights, checked exactly) and one for the rest. Options of one recompute
flag share their time prefix, and the end under the best option is ``min(T, best limit)``, T the
end the time budget allows. So per stage the limits of every start are worked out once
(:meth:`StageEnds.limits`), and a probe costs one bisection per device type and recompute flag.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from medley.plan.bounds import MemoryOption, stage_memory
from medley.plan.builder import Setting


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagLimits:
    """What ``stage_end`` needs of one stage under the options of one recompute flag, by first
    layer i.

    Attributes:
        times: (time prefix, micro-batches) of each device type of the stage, with or without
            recomputation as the flag says.
        plain: by i, the largest memory end of the flag's options that do not stream (-1: none).
        streams: (option index, buckets, memory end by i) of each streamed ZeRO-3 option of the
            flag; from i, an end short of i + buckets takes the exact check's
            (:meth:`StageEnds.short_end`).
        loose: by i, the largest memory end of any option of the flag, short streamed stages
            unchecked (what :meth:`StageEnds.upper` takes).
    """

    times: tuple[tuple[Sequence[float], int], ...]
    plain: list[int]
    streams: tuple[tuple[int, int, list[int]], ...]
    loose: list[int]


class StageEnds:
    """``stage_end(s, i, t)`` of :func:`~medley.plan.bounds.bottleneck_split` for ``setting``
    under the memory ``options`` (a part of the setting's ladder), with each stage's limits
    cached."""

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
        self._shorts: dict[tuple[int, int, int], int] = {}

    def __call__(self, s: int, i: int, t: float) -> int:
        flags = self._limits[s] or self.limits(s)
        best = i
        for flag in flags:
            end = self._num_layers  # the end the time budget allows on every type
            for times, c in flag.times:
                e = bisect_right(times, times[i] + t / c) - 1
                if e < end:
                    end = e
            plain = flag.plain[i]
            if plain < end:  # plain memory limits it: a streamed option may go further
                for o, buckets, memory in flag.streams:
                    memory_end, threshold = memory[i], i + buckets
                    if end >= threshold and memory_end >= threshold:
                        e = min(end, memory_end)
                    else:
                        e = min(end, self.short_end(s, o, i, memory_end))
                    if e > plain:
                        plain = e
                end = plain
            if end > best:
                best = end
        return best

    def upper(self, s: int, i: int, t: float) -> int:
        """A bound on ``self(s, i, t)`` that never decreases with i (as the time and memory
        prefixes do not): the exact check of short streamed stages left out, which only lowers
        ends. :func:`~medley.plan.bounds.bottleneck_split`'s ``upper_end``."""
        flags = self._limits[s] or self.limits(s)
        best = i
        for flag in flags:
            end = flag.loose[i]
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
        out = []
        for flag in dict.fromkeys(o.recompute for o in self._options):
            times = tuple((table.total_rc if flag else table.total, c)
                          for table, (_, c) in zip(self._tables[s], self._stage_types[s], strict=True))
            plain_ends, streams, loose_ends = [], [], []
            for o, option in enumerate(self._options):
                if option.recompute == flag:
                    ends = self.memory_ends(s, o)
                    loose_ends.append(ends)
                    if option.streams:
                        streams.append((o, option.buckets, ends.tolist()))
                    else:
                        plain_ends.append(ends)
            plain = np.maximum.reduce(plain_ends).tolist() if plain_ends else [-1] * (self._num_layers + 1)
            loose = np.maximum.reduce(loose_ends).tolist()
            out.append(FlagLimits(times=times, plain=plain, streams=tuple(streams), loose=loose))
        self._limits[s] = tuple(out)
        return self._limits[s]

    def memory_ends(self, s: int, o: int) -> np.ndarray:
        """By first layer i, the largest end the memory prefixes allow under option o on every
        type of stage s."""
        setting, st = self._setting, self._setting.structure
        return setting.ctx.memory_ends(self._types[s], st.micro_batch_size, setting.dtype, self._options[o],
                                       st.dp, setting.flights[s], setting.stage_tp(s))

    def short_end(self, s: int, o: int, i: int, memory_end: int) -> int:
        """The largest end below i + buckets (and up to ``memory_end``) that the exact check
        allows under streamed option o from layer i, every type of stage s in turn (short
        streamed stages gather a larger share of their weights than the prefix counts)."""
        key = (s, o, i)
        short = self._shorts.get(key)
        if short is None:
            option, flight, dp = self._options[o], self._setting.flights[s], self._setting.structure.dp
            short = min(memory_end, i + option.buckets - 1)
            for table, capacity in zip(self._tables[s], self._capacities[s], strict=True):
                while short > i and stage_memory(table, i, short, option=option, dp=dp,
                                                 in_flight=flight) > capacity:
                    short -= 1
            self._shorts[key] = short
        return short

