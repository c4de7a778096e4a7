"""The bottleneck sweep's cached ``stage_end`` (:class:`medley.search.rules.sweep.StageEnds`) equals
the per-option definition it replaces (on memory prefixes summed layer by layer, which the
vectorised ones equal float for float), its ``upper`` bound is a bound that never decreases with
the start, and :func:`medley.search.rules.sweep.bottleneck_split` answers the same with such a bound as
without it."""

from __future__ import annotations

from bisect import bisect_right
from functools import cache
from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from medley.cost.estimator import CatalogCostSource
from medley.cost.zero_memory import autocast_copy_bytes, state_bytes_per_param
from medley.search.estimate.bounds import Flight, memory_prefix, option_bytes_per_param, stage_memory
from medley.search.estimate.layer_table import LayerTable
from medley.search.rules.builder import Setting, balanced_micro_batches, build
from medley.search.rules.candidates import Estimator
from medley.search.rules.memory_rules import cheapest_per_stage
from medley.search.rules.sweep import StageEnds, bottleneck_split
from medley.search.space import MemoryOption
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

# Memory binds on these (short streamed stages fail the exact check from some starts).
CASES = [
    ("4xV100-32GB+4xT4-16GB", "llama-2-7b"),
    ("2xA100-80GB+4xV100-32GB", "llama-2-13b"),
    ("8xT4-16GB", "llama-2-7b"),
]


@cache
def _settings(cluster_arg: str, model_name: str) -> tuple[Setting, ...]:
    """The settings the 1F1B and ZB-H1 builds of every structure split (up to 4 stages), on one
    context: their sweeps share its memory limits (:attr:`PlanContext.sweep_memory`)."""
    cluster, model = parse_cluster_arg(cluster_arg), get_model(model_name)
    est = Estimator(cluster, model, CatalogCostSource.for_cluster(model, cluster), seq_len=2048,
                    global_batch=16, memory_headroom=0.05)
    seen: list[Setting] = []

    def capture(setting: Setting) -> None:
        seen.append(setting)

    pools = {"all": list(range(cluster.num_devices))}
    for structure in est.structures(pools, max_pp=4, micro_batch_sizes=(1, 2)):
        for family in ("1f1b", "zb-h1"):
            for level in (0, 1):  # ladders whose options sit at different indices share limits
                build(est, structure, family, split=capture, memory=cheapest_per_stage,
                      micro_batches=balanced_micro_batches(), replicated_level=level)
    return tuple(seen)


def _memory_prefix(table: LayerTable, option: MemoryOption, dp: int, flight: Flight) -> list[float]:
    """The memory prefix, one layer boundary at a time."""
    a = option_bytes_per_param(option, dp, dtype=table.dtype)
    c = autocast_copy_bytes(level=option.level, dp=dp, per_param=state_bytes_per_param(table.dtype))
    acts = table.act_rc if option.recompute else table.act
    casts = table.cast_rc if option.recompute else table.cast
    return [a * p + flight.full * (x + c * k) + flight.after_b * (y + c * k)
            for p, x, k, y in zip(table.params, acts, casts, table.after_b, strict=True)]


def _reference_end(setting: Setting, options: tuple[MemoryOption, ...], s: int, i: int, t: float) -> int:
    """The definition, option by option: the memory prefixes bound the end, short streamed
    stages are checked exactly, then each type's time budget bounds it; the best option's end."""
    ctx, st = setting.ctx, setting.structure
    types = ctx.cluster.device_types()
    best = i
    for option in options:
        end = ctx.model.num_layers
        for t_name, _ in setting.stage_types(s):
            memory = _memory_prefix(setting.table(s, t_name), option, st.dp, setting.flights[s])
            cap = types[t_name].memory_bytes * (1.0 - ctx.headroom)
            end = min(end, bisect_right(memory, memory[i] + cap) - 1)
        short = min(end, i + option.buckets - 1)
        for t_name, _ in setting.stage_types(s):
            table = setting.table(s, t_name)
            cap = types[t_name].memory_bytes * (1.0 - ctx.headroom)
            while option.streams and short > i and stage_memory(
                table, i, short, option=option, dp=st.dp, in_flight=setting.flights[s]
            ) > cap:
                short -= 1
        for t_name, c in setting.stage_types(s):
            times = setting.table(s, t_name).total_rc if option.recompute else setting.table(s, t_name).total
            end = min(end, bisect_right(times, times[i] + t / c) - 1)
        if option.streams and end - i < option.buckets:
            end = min(end, short)
        best = max(best, end)
    return best


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(CASES), pick=st.integers(0, 10_000), scale=st.floats(0.05, 3.0))
def test_cached_stage_end_equals_the_definition_and_upper_bounds_it(case, pick, scale) -> None:
    found = _settings(*case)
    setting = found[pick % len(found)]
    num_layers, pp = setting.ctx.model.num_layers, setting.structure.pp
    whole = max(setting.table(s, t).total[-1] * c for s in range(pp) for t, c in setting.stage_types(s))
    t = whole / pp * scale
    for options in (setting.ladder[:1], setting.ladder):
        ends = StageEnds(setting, options)
        for s in range(pp):
            previous = 0
            for i in range(num_layers + 1):
                got = ends(s, i, t)
                assert got == _reference_end(setting, options, s, i, t), (s, i, t)
                upper = ends.upper(s, i, t)
                assert upper >= got and upper >= previous
                previous = upper


def test_the_memory_prefix_is_the_same_floats_as_layer_by_layer() -> None:
    for setting in _settings(*CASES[1])[:8]:
        st = setting.structure
        for s in range(st.pp):
            for t_name, _ in setting.stage_types(s):
                for option in setting.ladder:
                    table, flight = setting.table(s, t_name), setting.flights[s]
                    got = memory_prefix(table, option=option, dp=st.dp, flight=flight)
                    assert got.tolist() == _memory_prefix(table, option, st.dp, flight)


def test_the_instances_exercise_the_exact_check_of_short_streamed_stages() -> None:
    reduced = 0
    for setting in _settings(*CASES[0]):
        ends = StageEnds(setting, setting.ladder)
        for s in range(setting.structure.pp):
            for o, option in enumerate(setting.ladder):
                if option.streams:
                    memory = next(f.memory for f in ends.limits(s)
                                  if any(streamed == option for streamed, _, _ in f.memory.streams))
                    for i in range(setting.ctx.model.num_layers):
                        end = int(ends.memory_ends(s, o)[i])
                        short = ends.short_end(s, memory, option, i, end)
                        reduced += short < min(end, i + option.buckets - 1)
    assert reduced


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.integers(1, 9), min_size=2, max_size=10),
    stages=st.integers(1, 4),
    dips=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10)), max_size=6),
)
def test_bottleneck_split_answers_the_same_with_an_upper_bound(costs, stages, dips) -> None:
    """Ends that dip at some starts (a stage_end that is not monotone, as short streamed stages
    make it; the greedy gets stuck there and the program goes around) and their running maximum
    as the bound: the same split and budget."""
    n = len(costs)
    if stages > n:
        return
    prefix = [0, *accumulate(costs)]
    dipped = {(s, i) for s, i in dips if i < n}

    def stage_end(s: int, i: int, t: float) -> int:
        j = i
        while j < n and (prefix[j + 1] - prefix[i]) * (1 + s) / 2 <= t:
            j += 1
        return i if (s, i) in dipped else j  # no layer fits from a dipped start

    def upper_end(s: int, i: int, t: float) -> int:
        return max(stage_end(s, k, t) for k in range(i + 1))

    hi = float(sum(costs)) * 3
    plain = bottleneck_split(n, stages, stage_end, lo=0.0, hi=hi, iterations=40)
    bounded = bottleneck_split(n, stages, stage_end, lo=0.0, hi=hi, iterations=40, upper_end=upper_end)
    assert bounded == plain
