"""Memory rules of :func:`medley.search.rules.builder.build`: a memory option per stage for a split (a
rule may also move layers, as Metis' load balancer does), or None when the split cannot fit."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import accumulate

import numpy as np

from medley.cost.recompute import FULL, SELECTIVE, Recompute
from medley.schedule.generators import generate
from medley.schedule.generators.classic import one_f_one_b_depth
from medley.schedule.validate import in_flight_by_stage
from medley.search.estimate.bounds import stage_memory
from medley.search.rules.builder import MemoryRule, Setting, StagePlan
from medley.search.space import MemoryOption


def cheapest_per_stage(setting: Setting, split: tuple[int, ...], *, finer: bool = True) -> StagePlan | None:
    """Memory rule: each stage takes the first option of the setting's ladder under which it
    fits every device type that runs it; where that option recomputes (the ladder's full
    recomputation) and ``finer``, the least rerun time under which the stage still fits
    (:func:`lightest_recompute`; baselines that recompute all or nothing pass False)."""
    options = []
    start = 0
    for s, n in enumerate(split):
        fit = next((o for o in setting.ladder if _stage_fits(setting, s, start, n, o)), None)
        if fit is None:
            return None
        if fit.recompute and finer:
            fit = lightest_recompute(setting, s, start, n, fit)
        options.append(fit)
        start += n
    return StagePlan(stage_layers=split, options=tuple(options))


def lightest_recompute(setting: Setting, s: int, start: int, n: int, option: MemoryOption) -> MemoryOption:
    """``option`` (which fits stage ``s``, layers start..start+n) with the recomputation of least
    rerun time, at its ZeRO level and buckets, under which the stage fits every device type that
    runs it (:func:`least_rerun`)."""
    model = setting.ctx.model
    blocks = sum(model.layer_kind(i) == "block" for i in range(start, start + n))

    def fits(rc: Recompute) -> bool:
        return _stage_fits(setting, s, start, n, replace(option, recompute=rc))

    def seconds(rc: Recompute) -> float:
        return max(setting.table(s, t).time(start, start + n, recompute=rc)
                   for t, _ in setting.stage_types(s))

    return replace(option, recompute=least_rerun(blocks, fits, seconds))


def least_rerun(blocks: int, fits: Callable[[Recompute], bool],
                seconds: Callable[[Recompute], float]) -> Recompute:
    """Of the recomputations a stage (or a rank's chunks) of at most ``blocks`` blocks may take,
    the one of least ``seconds`` under which it ``fits``, given that full recomputation of every
    block fits: selective on every block, full or selective on the fewest first blocks (the least
    k, found by bisection: a stage's memory does not grow with k, tests/plan/test_recompute_search.py),
    or full on every block."""

    def fewest(mode: str) -> Recompute | None:
        """The least k < blocks with MODE:k fitting (None when only all blocks do)."""
        lo, hi = 1, blocks  # hi: all blocks, known to fit for the caller's mode
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(Recompute(mode, mid)):
                hi = mid
            else:
                lo = mid + 1
        return Recompute(mode, lo) if lo < blocks else None

    found: list[Recompute | None] = [FULL]
    if blocks > 1:
        found.append(fewest("full"))
    if fits(SELECTIVE):
        found.append(SELECTIVE)
        if blocks > 1:
            found.append(fewest("selective"))
    return min((rc for rc in found if rc is not None), key=seconds)


def given(options: Sequence[MemoryOption]) -> MemoryRule:
    """Memory rule: ``options`` (one per stage), or None when a stage would not fit under its own
    (one stage per rank: not for interleaved 1F1B)."""

    def rule(setting: Setting, split: tuple[int, ...]) -> StagePlan | None:
        starts = [0, *accumulate(split)]
        if not all(_stage_fits(setting, s, starts[s], n, options[s]) for s, n in enumerate(split)):
            return None
        return StagePlan(stage_layers=split, options=tuple(options))

    return rule


def _stage_fits(setting: Setting, s: int, start: int, n: int, option: MemoryOption) -> bool:
    """Whether stage ``s`` (layers start..start+n) fits every device type that runs it."""
    return all(
        stage_memory(setting.table(s, t), start, start + n, option=option, dp=setting.structure.zero_dp,
                     in_flight=setting.flights[s])
        <= setting.ctx.type_capacity(t)
        for t, _ in setting.stage_types(s)
    )


def cheapest_per_rank(setting: Setting, split: tuple[int, ...], *, finer: bool = True) -> StagePlan | None:
    """Memory rule for interleaved 1F1B: every chunk of a rank takes the cheapest option under
    which the rank fits at every moment of its schedule: its chunks' in-flight micro-batches
    after each forward (:func:`chunk_in_flight`) weighted by each chunk's activation bytes, on
    top of the chunks' state."""
    ctx, st, v = setting.ctx, setting.structure, setting.virtual_stages
    pp, dp, stages = st.pp, st.zero_dp, setting.num_stages
    moments = chunk_in_flight(pp, max(setting.counts), v)
    ladder = setting.ladder
    options: list[MemoryOption | None] = [None] * stages
    starts = [sum(split[:c]) for c in range(stages)]
    for rank in range(pp):
        chunks = [c for c in range(stages) if c % pp == rank]
        types = {sig[rank] for sig, _ in setting.signatures}
        cap = {
            t: min(
                ctx.capacity(row[rank])
                for row in st.assignment
                if ctx.cluster.devices[row[rank]].type.name == t
            )
            for t in types
        }

        def peak(option: MemoryOption, t: str, chunks: list[int] = chunks, rank: int = rank) -> float:
            held = [stage_memory(setting.table(c, t), starts[c], starts[c] + split[c], option=option, dp=dp,
                                 in_flight=0) for c in chunks]
            per_micro_batch = np.array([
                stage_memory(setting.table(c, t), starts[c], starts[c] + split[c], option=option, dp=dp,
                             in_flight=1) - h for c, h in zip(chunks, held, strict=True)
            ])
            return sum(held) + float((moments[rank] @ per_micro_batch).max())

        fit = next((o for o in ladder if all(peak(o, t) <= cap[t] for t in types)), None)
        if fit is None:
            return None
        if fit.recompute and finer:
            def fits(rc: Recompute, fit: MemoryOption = fit, types: set[str] = types,
                     peak: Callable[[MemoryOption, str], float] = peak, cap: dict[str, float] = cap) -> bool:
                return all(peak(replace(fit, recompute=rc), t) <= cap[t] for t in types)

            def seconds(rc: Recompute, chunks: list[int] = chunks, types: set[str] = types) -> float:
                return max(sum(setting.table(c, t).time(starts[c], starts[c] + split[c], recompute=rc)
                               for c in chunks) for t in types)

            most = max(sum(ctx.model.layer_kind(i) == "block" for i in range(starts[c], starts[c] + split[c]))
                       for c in chunks)
            fit = replace(fit, recompute=least_rerun(most, fits, seconds))
        for c in chunks:
            options[c] = fit
    return StagePlan(stage_layers=split, options=tuple(o for o in options if o is not None))


@functools.lru_cache(maxsize=256)
def chunk_in_flight(pp: int, micro_batches: int, virtual_stages: int) -> tuple[np.ndarray, ...]:
    """Per pipeline rank of the interleaved schedule, its chunks' in-flight micro-batches at each
    distinct moment (rows; columns: the rank's chunks, first to last), read from the generated
    schedule the simulator and the runtime run (:func:`medley.schedule.validate.in_flight_by_stage`).
    (Megatron's warm-up depth, 2(p-k-1) + (v-1)·min(m, p) + 1, spread evenly over the chunks,
    under-counted medley's schedule, whose first chunks hold more: plans booked as fitting
    overflowed by 15-21%.)"""
    schedule = generate("interleaved", pp=pp, micro_batches=micro_batches, virtual_stages=virtual_stages)
    # The distinct rows in lexicographic order (np.unique's, axis=0), deduplicated before any
    # array is made: the counts are whole numbers, so comparing the tuples is comparing the rows.
    return tuple(np.array(sorted({(0.0,) * virtual_stages, *trace}))
                 for trace in in_flight_by_stage(schedule))


def _one_f_one_b_flight(setting: Setting, stage: int) -> int:
    """1F1B's in-flight micro-batches at ``stage`` with the most micro-batches of any replica."""
    return one_f_one_b_depth(setting.structure.pp, stage, max(setting.micro_batches))


def first_uniform_fit(choices: Sequence[MemoryOption], *, device_type: str, capacity: float) -> MemoryRule:
    """Memory rule: the first of ``choices`` under which every stage fits, every device seen as
    ``device_type`` with ``capacity`` bytes (a homogeneous planner's view of a mixed cluster)."""

    def rule(setting: Setting, split: tuple[int, ...]) -> StagePlan | None:
        starts = [sum(split[:s]) for s in range(len(split))]
        for option in choices:
            if all(
                stage_memory(
                    setting.ctx.table(device_type, setting.structure.micro_batch_size,
                                      tp=setting.stage_tp(s)),
                    starts[s],
                    starts[s] + split[s],
                    option=option,
                    dp=setting.structure.zero_dp,
                    in_flight=_one_f_one_b_flight(setting, s),
                )
                <= capacity
                for s in range(len(split))
            ):
                return StagePlan(stage_layers=split, options=(option,) * len(split))
        return None

    return rule


def rebalanced_uniform_fit(choices: Sequence[MemoryOption]) -> MemoryRule:
    """Memory rule as Metis' LayerLoadBalancer: for each of ``choices`` in turn, move layers off
    stages short of memory to the neighbour with the most room; the first option under which
    every stage then fits is every stage's."""

    def rule(setting: Setting, split_in: tuple[int, ...]) -> StagePlan | None:
        ctx, st = setting.ctx, setting.structure
        mbs, pp, dp = st.micro_batch_size, st.pp, st.dp
        names = [[ctx.cluster.devices[st.assignment[r][k]].type.name for k in range(pp)] for r in range(dp)]
        caps = [min(ctx.capacity(st.assignment[r][k]) for r in range(dp)) for k in range(pp)]
        split = list(split_in)

        def memory(k: int, option: MemoryOption) -> float:
            start = sum(split[:k])
            return max(
                stage_memory(
                    ctx.table(t, mbs, tp=st.tp_of(k)),
                    start,
                    start + split[k],
                    option=option,
                    dp=dp,
                    in_flight=_one_f_one_b_flight(setting, k),
                )
                for t in {names[r][k] for r in range(dp)}
            )

        for option in choices:
            for _ in range(4 * ctx.model.num_layers):
                over = [k for k in range(pp) if memory(k, option) > caps[k]]
                if not over:
                    break
                k = over[0]
                if split[k] <= 1:
                    break
                room = [j for j in (k - 1, k + 1) if 0 <= j < pp and memory(j, option) < caps[j]]
                if not room:
                    break
                split[k] -= 1
                split[max(room, key=lambda j: caps[j] - memory(j, option))] += 1
            if all(memory(k, option) <= caps[k] for k in range(pp)):
                return StagePlan(stage_layers=tuple(split), options=(option,) * pp)
        return None

    return rule


def fixed(option: MemoryOption) -> MemoryRule:
    """Memory rule: ``option`` on every stage, fitting or not (the caller judges)."""
    return lambda setting, split: StagePlan(stage_layers=split, options=(option,) * len(split))
