"""The bottleneck sweep's ``stage_end`` for one setting (:func:`medley.plan.split_rules.bottleneck`).

``stage_end(s, i, t)`` is the largest end j such that stage s holding layers i..j-1 fits the time
budget t on every device type that runs it (a type running c micro-batches per step has t / c)
and, under at least one memory option of a given set, the memory of every such type; i when not
even one layer fits.

The sweep asks it about a million times in a 1,024-device search, so it is arranged for that.
Memory does not depend on the budget: under each option the memory allows ends up to a cap, and a
streamed ZeRO-3 option has two caps, one for ends short of its bucket count (such stages gather a
larger share of their weights, checked exactly) and one for the rest. Options of one recompute
flag share their time prefix, and the end under the best option is ``min(T, best cap)``, T the
end the time budget allows. So per (stage, start) the caps are worked out once
(:meth:`StageEnds.caps`), and a probe costs one bisection per device type and recompute flag.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from medley.plan.bounds import MemoryOption, stage_memory
from medley.plan.builder import Setting


@dataclass(frozen=True, kw_only=True, slots=True)
class FlagCaps:
    """What ``stage_end`` needs for one start i of one stage and one recompute flag.

    Attributes:
        times: (time prefix, micro-batches) of each device type of the stage, with or without
            recomputation as the flag says.
        plain: the largest memory end of the flag's options that do not stream (-1: none).
        streams: (option index, threshold i + buckets, memory end) of each streamed ZeRO-3
            option of the flag; below the threshold its end is the exact check's ``short``.
        loose: the largest memory end of any option of the flag, short streamed stages
            unchecked (what :meth:`StageEnds.upper` takes).
    """

    times: tuple[tuple[tuple[float, ...], int], ...]
    plain: int
    streams: tuple[tuple[int, int, int], ...]
    loose: int


class StageEnds:
    """``stage_end(s, i, t)`` of :func:`~medley.plan.bounds.bottleneck_split` for ``setting``
    under the memory ``options`` (a part of the setting's ladder), with the caps cached."""

    def __init__(self, setting: Setting, options: Sequence[MemoryOption]) -> None:
        ctx, st = setting.ctx, setting.structure
        self._setting = setting
        self._options = tuple(options)
        self._num_layers = ctx.model.num_layers
        stage_types = [setting.stage_types(s) for s in range(st.pp)]
        self._types = [[t for t, _ in pairs] for pairs in stage_types]
        self._tables = [[setting.table(s, t) for t, _ in pairs] for s, pairs in enumerate(stage_types)]
        self._capacities = [[ctx.type_capacity(t) for t, _ in pairs] for pairs in stage_types]
        flags = {o.recompute for o in self._options}
        self._times = [
            {
                flag: tuple((table.total_rc if flag else table.total, c)
                            for table, (_, c) in zip(tables, pairs, strict=True))
                for flag in flags
            }
            for tables, pairs in zip(self._tables, stage_types, strict=True)
        ]
        self._memory: dict[tuple[int, int], list[int]] = {}  # (stage, option): memory end by start
        self._caps: list[list[tuple[FlagCaps, ...] | None]] = [
            [None] * (self._num_layers + 1) for _ in range(st.pp)
        ]
        self._shorts: dict[tuple[int, int, int], int] = {}

    def __call__(self, s: int, i: int, t: float) -> int:
        flags = self._caps[s][i]
        if flags is None:
            flags = self._caps[s][i] = self.caps(s, i)
        best = i
        for flag in flags:
            end = self._num_layers  # the end the time budget allows on every type
            for times, c in flag.times:
                e = bisect_right(times, times[i] + t / c) - 1
                if e < end:
                    end = e
            if flag.plain < end:  # plain memory caps it: a streamed option may go further
                cap = flag.plain
                for o, threshold, memory_end in flag.streams:
                    if end >= threshold and memory_end >= threshold:
                        e = min(end, memory_end)
                    else:
                        e = min(end, self.short_end(s, o, i, memory_end))
                    if e > cap:
                        cap = e
                end = cap
            if end > best:
                best = end
        return best

    def upper(self, s: int, i: int, t: float) -> int:
        """A bound on ``self(s, i, t)`` that never decreases with i (as the time and memory
        prefixes do not): the exact check of short streamed stages left out, which only lowers
        ends. :func:`~medley.plan.bounds.bottleneck_split`'s ``upper_end``."""
        flags = self._caps[s][i]
        if flags is None:
            flags = self._caps[s][i] = self.caps(s, i)
        best = i
        for flag in flags:
            end = flag.loose
            for times, c in flag.times:
                e = bisect_right(times, times[i] + t / c) - 1
                if e < end:
                    end = e
            if end > best:
                best = end
        return best

    def caps(self, s: int, i: int) -> tuple[FlagCaps, ...]:
        """Per recompute flag among the options, what bounds stage s from start i. Under a plain
        option the end is min(T, its memory end), T the end the time allows; under a streamed
        one it is min(T, memory end) when both reach its threshold i + buckets, and
        min(T, ``short``) otherwise (:meth:`short_end`); the best option's end counts."""
        out = []
        for flag, times in self._times[s].items():
            plain, streams = -1, []
            for o, option in enumerate(self._options):
                if option.recompute != flag:
                    continue
                end = self.memory_end(s, o, i)
                if option.streams:
                    streams.append((o, i + option.buckets, end))
                else:
                    plain = max(plain, end)
            loose = max((plain, *(end for _, _, end in streams)))
            out.append(FlagCaps(times=times, plain=plain, streams=tuple(streams), loose=loose))
        return tuple(out)

    def memory_end(self, s: int, o: int, i: int) -> int:
        """The largest end the memory prefixes allow from layer i under option o on every type
        of stage s."""
        ends = self._memory.get((s, o))
        if ends is None:
            setting, st = self._setting, self._setting.structure
            per_type = [
                setting.ctx.memory_ends(t, st.micro_batch_size, setting.dtype, self._options[o], st.dp,
                                        setting.flights[s], setting.stage_tp(s))
                for t in self._types[s]
            ]
            ends = self._memory[s, o] = per_type[0] if len(per_type) == 1 else list(map(min, *per_type))
        return ends[i]

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
