"""Where the best plan's gain over the best baseline comes from: one constrained search per freedom
of the planner, each simulated exactly (no formula splits the gain).

Each step takes one freedom away and searches again over the same cluster, model and costs:

* ``schedule``: 1F1B only (the planner's own search with ``--schedules 1f1b``);
* ``heterogeneity``: a homogeneous treatment of the devices: ranks in cluster order (no
  type-aware assignment), a uniform layer split (not polished) and the same micro-batch count on
  every replica (within one), on all devices or one device type's or the k fastest types'
  devices; schedules, ZeRO per stage and bubble placement stay free;
* ``zero-and-placement``: one memory option (ZeRO level, recomputation) for every stage and the
  collectives after the step (naive placement); assignment, split (polished as the planner's:
  :mod:`medley.search.rank.polish`) and schedules stay free;
* ``tp``: tensor-parallel degree 1 everywhere (the planner's own search with
  ``Constraints.tp_degrees = (1,)``);
* ``replica-shapes``: alike replicas only (the planner's own search with
  ``Constraints.asymmetric = False``: no replica groups of their own shape).

The homogeneous search keeps one tp degree for all stages (Megatron's grid: any degree a node of
the pool holds); the one-ZeRO-option search takes the planner's structures, tp included.

Steps are independent (each removes one freedom from the full space), so their shares of the gain
need not add up; a step can come out faster than the best plan where the planner's own pruning
missed a plan that the constrained search finds (the share is then negative).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from medley.schedule.zero_settings import Placement
from medley.search.planner import SearchResult, device_pools, family_variants, search
from medley.search.rank.baselines import Scored, add_candidate, one_option_for_all, rank_finalists
from medley.search.rank.polish import polish_leaders
from medley.search.rank.ranking import RankedPlan
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.rules.candidates import Estimator
from medley.search.rules.tp_structures import tp_degrees, tp_groups
from medley.search.space import MICRO_BATCH_SIZES, PP_CHOICES, Candidate, Constraints, Structure

STEPS = ("schedule", "heterogeneity", "zero-and-placement", "tp", "replica-shapes")
REMOVED = {
    "schedule": "1F1B only",
    "heterogeneity": "cluster order, uniform split, equal micro-batches",
    "zero-and-placement": "one memory option for all stages, naive ZeRO placement",
    "tp": "tp 1 on every stage",
    "replica-shapes": "alike replicas only",
}
EXPANDED = 12
"""Structures whose 1F1B estimate is among the best EXPANDED are expanded into every family."""
FINALISTS = 12
"""Candidates simulated exactly per constrained search (besides the best of each family)."""


@dataclass(frozen=True, kw_only=True)
class AblationStep:
    """One constrained search.

    Attributes:
        name: one of :data:`STEPS`; removed: what the search was not allowed.
        plan: its best plan that fits (None: none fits under the constraint).
        step_time_s: that plan's simulated step seconds (None when no plan fits).
        share_of_gain: ln(step / best step) / ln(best baseline's step / best step): the part of the
            best plan's gain over the best baseline this freedom accounts for alone (None when the
            best plan does not beat the best baseline or no plan fits).
        note: how the figure was obtained where it is not a search of its own.
    """

    name: str
    removed: str
    plan: RankedPlan | None
    step_time_s: float | None
    share_of_gain: float | None
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Ablation:
    """The best plan, the best baseline, and one :class:`AblationStep` per freedom."""

    best_step_s: float
    baseline: str | None
    baseline_step_s: float | None
    steps: tuple[AblationStep, ...]


def ablate(result: SearchResult) -> Ablation:
    """One constrained search per freedom of :data:`STEPS` for ``result``'s instance."""
    best = result.best.prediction.step_time_s
    found = {n: b for n, b in result.baselines.items() if b is not None}
    name = min(found, key=lambda n: found[n].prediction.step_time_s) if found else None
    base = found[name].prediction.step_time_s if name else None
    searches: dict[str, Callable[[SearchResult], tuple[RankedPlan | None, str]]] = {
        "schedule": _one_f_one_b,
        "heterogeneity": _homogeneous,
        "zero-and-placement": _uniform_zero,
        "tp": _tp_one,
        "replica-shapes": _alike_only,
    }
    steps = []
    for step in STEPS:
        plan, note = searches[step](result)
        seconds = None if plan is None else plan.prediction.step_time_s
        share = None
        if seconds is not None and base is not None and base > best:
            share = math.log(seconds / best) / math.log(base / best)
        steps.append(
            AblationStep(name=step, removed=REMOVED[step], plan=plan, step_time_s=seconds,
                         share_of_gain=share, note=note)
        )
    return Ablation(best_step_s=best, baseline=name, baseline_step_s=base, steps=tuple(steps))


def _one_f_one_b(result: SearchResult) -> tuple[RankedPlan | None, str]:
    return _constrained(result, replace(result.constraints, schedules=("1f1b",)))


def _tp_one(result: SearchResult) -> tuple[RankedPlan | None, str]:
    return _constrained(result, replace(result.constraints, tp_degrees=(1,)))


def _alike_only(result: SearchResult) -> tuple[RankedPlan | None, str]:
    return _constrained(result, replace(result.constraints, asymmetric=False))


def _constrained(result: SearchResult, constraints: Constraints) -> tuple[RankedPlan | None, str]:
    """The planner's own search under ``constraints`` (None: nothing fits)."""
    try:
        found = search(
            result.cluster, result.model, global_batch=result.global_batch, seq_len=result.seq_len,
            cost=result.cost, objective=result.objective, top=1, constraints=constraints, baselines=False,
        )
    except ValueError:  # MedleyInputError included: nothing fits under the constraint
        return None, ""
    return found.best, ""


def _estimator(result: SearchResult) -> tuple[Estimator, list[int], tuple[int, ...]]:
    c = result.constraints
    est = Estimator(result.cluster, result.model, result.cost, seq_len=result.seq_len,
                    global_batch=result.global_batch, memory_headroom=c.memory_headroom, dtype=c.dtype,
                    adapter=c.adapter)
    devices = [d for d in range(result.cluster.num_devices) if d not in set(c.exclude_devices)]
    sizes = tuple(s for s in (c.micro_batch_sizes or MICRO_BATCH_SIZES) if result.global_batch % s == 0)
    return est, devices, sizes


Make = Callable[[Structure, str, int, int], "Candidate | None"]
"""Builds the candidate of a structure, family, chunks per rank and replicated ZeRO level."""


def constrained_search(
    est: Estimator,
    structures: Sequence[Structure],
    make: Make,
    constraints: Constraints,
    placements: Sequence[Placement],
) -> list[RankedPlan]:
    """The planner's method under other rules: every structure's 1F1B estimate, the EXPANDED best
    structures in every allowed family, the FINALISTS best (and each family's best) simulated;
    those that fit, fastest first."""
    base: Scored = []
    for st in structures:
        for level in (0, 1) if st.dp > 1 else (0,):
            add_candidate(base, lambda st=st, level=level: make(st, "1f1b", 1, level))
    base.sort(key=lambda x: (x[0], x[1]))
    keep = list(dict.fromkeys((c.structure, _level(c)) for _, _, c in base))[:EXPANDED]
    scored: Scored = list(base)
    for st, level in keep:
        for family, knobs in family_variants(constraints.schedules):
            if family == "1f1b" or st.pp == 1:
                continue
            chunks = int(knobs.get("virtual_stages", 1))
            if family == "interleaved" and st.pp * chunks > est.model.num_layers:
                continue
            add_candidate(scored, lambda st=st, f=family, v=chunks, lv=level: make(st, f, v, lv))
    return rank_finalists(est, scored, constraints, placements, finalists=FINALISTS)


def _level(candidate: Candidate) -> int:
    """The replicated ZeRO level the candidate's ladder started at (1 when no stage is plain)."""
    return 0 if any(o.level == 0 for o in candidate.options) else 1


def _homogeneous(result: SearchResult) -> tuple[RankedPlan | None, str]:
    est, devices, sizes = _estimator(result)
    pools = device_pools(result.cluster, devices, est)
    structures = list(_cluster_order(est, pools, sizes, result.constraints))

    def make(st: Structure, family: str, chunks: int, level: int) -> Candidate | None:
        interleaved = family == "interleaved"
        return builder.build(
            est, st, family, split=split_rules.uniform,
            memory=memory_rules.cheapest_per_rank if interleaved else memory_rules.cheapest_per_stage,
            micro_batches=builder.equal_micro_batches(), virtual_stages=chunks, replicated_level=level,
        )

    placements = (Placement.BUBBLE, Placement.NAIVE)
    found = constrained_search(est, structures, make, result.constraints, placements)
    return (found[0] if found else None), ""


def _cluster_order(
    est: Estimator, pools: dict[str, list[int]], sizes: Sequence[int], constraints: Constraints
) -> Iterator[Structure]:
    """Every pool's tp x pp x dp in cluster order (Megatron's rank order: tp, dp, then pp; one tp
    degree for all stages, among those ``constraints.tp_degrees`` allows)."""
    for pool, devices in pools.items():
        for tp in tp_degrees(est, devices):
            if constraints.tp_degrees is not None and tp not in constraints.tp_degrees:
                continue
            leads = tp_groups(est, sorted(devices), tp)
            limit = min(len(leads), est.model.num_layers, constraints.max_pp or len(leads))
            for pp in (p for p in PP_CHOICES if p <= limit):
                for mbs in sizes:
                    dp = min(len(leads) // pp, est.global_batch // mbs)
                    yield Structure(
                        pool=pool, strategy="cluster-order", pp=pp, dp=dp,
                        assignment=est.assign(leads, pp, dp, "stage-major"), micro_batch_size=mbs,
                        tp=(tp,) * pp if tp > 1 else (),
                    )


def _uniform_zero(result: SearchResult) -> tuple[RankedPlan | None, str]:
    est, devices, sizes = _estimator(result)
    pools = device_pools(result.cluster, devices, est)
    max_pp = result.constraints.max_pp or result.model.num_layers
    structures = list(est.structures(pools, max_pp=max_pp, micro_batch_sizes=sizes,
                                     allowed_tp=result.constraints.tp_degrees))

    def make(st: Structure, family: str, chunks: int, level: int) -> Candidate | None:
        if family != "interleaved":
            return builder.build(
                est, st, family, split=split_rules.bottleneck, memory=one_option_for_all(),
                micro_batches=builder.balanced_micro_batches(), replicated_level=level,
            )
        base = make(st, "1f1b", 1, level)  # interleaved keeps 1F1B's micro-batches, as the planner
        return None if base is None else builder.build(
            est, st, family, split=split_rules.interleaved_chunks, memory=one_option_for_all(),
            micro_batches=builder.given_micro_batches(base.micro_batches), virtual_stages=chunks,
            replicated_level=level,
        )

    found = constrained_search(est, structures, make, result.constraints, (Placement.NAIVE,))
    if not found:
        return None, ""
    # The split stays free here, and the planner polishes the splits of its best plan and of the
    # runners-up close to it: so does this step (one memory option for all stages: the polished
    # neighbours keep it).
    keys = {p.candidate.key for p in found}
    improved = polish_leaders(found, est, result.cluster, result.cost, result.constraints,
                              result.objective, keys)
    return (improved[-1] if improved else found[0]), ""
