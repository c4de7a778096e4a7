"""The planner: a joint search over device assignment, pp x dp, layer split, micro-batching, schedule
family and knobs, and ZeRO level and recomputation per stage (Quartet + HyperPipe + ZIPPer).

Method. Every structure (device pool, assignment strategy, pp x dp, micro-batch size; see
:mod:`medley.search.rules.candidates`) gets a 1F1B estimate: micro-batches per replica in proportion to
replica speed, the bottleneck-sweep split under memory, the cheapest memory option per stage.
The best structures (overall and per device pool) are expanded into every allowed schedule family;
the best ``simulate`` of those by estimate are compiled to the IR and simulated exactly with
:func:`medley.lowering.predict.predict`, checked against memory, and ranked by simulated throughput
(or cost per token); the neighbours one layer away that the estimate ties of the best plan and of
the runners-up close to it are simulated too, and those that improve on the best join the ranking
(:mod:`medley.search.rank.polish`). Candidates whose estimate lies far behind the fastest simulated step
are not simulated (:data:`medley.search.rank.ranking.SIMULATE_WITHIN`). Bounds only prune: every figure
reported comes from a simulation. The search is deterministic: fixed enumeration order, ties
broken by the enumeration index.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field

from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import CostSource, ProfileRangeError
from medley.cost.tp_cost import TensorPricing
from medley.errors import MedleyInputError
from medley.plan.layout import TP_DEGREES
from medley.search.estimate.bounds import aggregate_bound
from medley.search.estimate.structure_bound import StructureBounds
from medley.search.rank import ranking
from medley.search.rank.baselines import run_baselines
from medley.search.rank.polish import polish_leaders
from medley.search.rank.ranking import (
    Objective,
    Progress,
    RankedPlan,
    best_placement,
    choose,
    objective_key,
    simulate_all,
    simulate_grouped,
    simulation_budget,
)
from medley.search.rank.shortfall import shortfall_error
from medley.search.rules.asymmetric import grouped_candidates, partitions, seeds_of
from medley.search.rules.candidates import Estimator
from medley.search.space import MICRO_BATCH_SIZES, SEARCHED_FAMILIES, Candidate, Constraints, Structure
from medley.sim.engine import collector_paused
from medley.spec.catalog import check_precision
from medley.spec.cluster import Cluster
from medley.spec.limits import MAX_MICRO_BATCHES, MAX_PLAN_DEVICES
from medley.spec.model import ModelSpec

INTERLEAVE_DEPTHS = (2, 4)

# Pruning of the 1F1B estimates (see :func:`_estimate`). A structure's bound is a lower bound on its
# 1F1B estimate (:mod:`medley.search.estimate.structure_bound`), so one whose bound, or refined bound, cannot
# beat the ESTIMATE_RIVALS-th best estimate so far is skipped once its device pool already has
# POOL_ESTIMATES estimates (every pool keeps a few, so that single-type plans and baselines are
# compared on the same footing). Of the estimates, the EXPANDED_STRUCTURES best, and at least
# POOL_ESTIMATES per pool, are expanded into every family: the analytic estimate is a few percent
# off, so near-best structures are kept, not just the best.
ESTIMATE_RIVALS = 6
POOL_ESTIMATES = 2
EXPANDED_STRUCTURES = 12
# Replica groups of their own shape (medley.search.rules.asymmetric): the devices of the GROUPED_FROM best
# simulated plans seed partitions (with the devices they leave idle), and the GROUPED_SIMULATED
# best grouped candidates by estimate are simulated.
GROUPED_FROM = 2
GROUPED_SIMULATED = 3


@dataclass(kw_only=True)
class SearchResult:
    """What :func:`search` found: ranked plans, baselines, the aggregate bound, and the material
    for ``--explain`` (the estimator and every simulated plan)."""

    plans: list[RankedPlan]
    baselines: dict[str, RankedPlan | None]
    aggregate_tokens_per_s: float
    objective: Objective
    cluster: Cluster
    model: ModelSpec
    cost: CostSource
    pricing: TensorPricing  # the search's TP pricing (its context's), for what is simulated after it
    global_batch: int
    seq_len: int
    constraints: Constraints
    simulated: list[RankedPlan] = field(default_factory=list)
    estimated: list[Candidate] = field(default_factory=list)  # every candidate estimated, in order
    structures_estimated: int = 0
    best_single_type: RankedPlan | None = None

    @property
    def best(self) -> RankedPlan:
        return self.plans[0]


def _check_inputs(
    cluster: Cluster,
    model: ModelSpec,
    global_batch: int,
    seq_len: int,
    constraints: Constraints,
    objective: str,
) -> list[int]:
    if not 1 <= global_batch <= MAX_MICRO_BATCHES:
        raise MedleyInputError(
            f"--global-batch {global_batch}: give 1..{MAX_MICRO_BATCHES:,} sequences per step (the limit: "
            "one replica of micro-batch size 1 runs at most that many micro-batches)."
        )
    if cluster.num_devices > MAX_PLAN_DEVICES:
        raise MedleyInputError(
            f"--cluster: {cluster.num_devices:,} devices; the planner searches at most {MAX_PLAN_DEVICES:,} "
            "(it simulates every rank of its best plans): plan a part of the cluster."
        )
    if seq_len < 1:
        raise MedleyInputError(f"--seq-len {seq_len}: give a positive number of tokens per sequence.")
    model.check_seq_len(seq_len)
    unknown = sorted(set(constraints.schedules) - set(SEARCHED_FAMILIES))
    if unknown or not constraints.schedules:
        raise MedleyInputError(
            f"--schedules: the planner searches {', '.join(SEARCHED_FAMILIES)}; {unknown or 'none'} given. "
            "Pick from those (zb-h2 and bidirectional plans: use `medley simulate`)."
        )
    if not 0.0 <= constraints.memory_headroom < 1.0:
        raise MedleyInputError(f"--memory-headroom {constraints.memory_headroom}: give a fraction in [0, 1).")
    bad = [d for d in constraints.exclude_devices if not 0 <= d < cluster.num_devices]
    if bad:
        raise MedleyInputError(
            f"--exclude-devices {bad}: device ids run 0..{cluster.num_devices - 1} (`medley cluster show`)."
        )
    if constraints.tp_degrees is not None and (
        not constraints.tp_degrees or set(constraints.tp_degrees) - set(TP_DEGREES)
    ):
        raise MedleyInputError(
            f"tp_degrees {constraints.tp_degrees}: give degrees among {TP_DEGREES} (None: all)."
        )
    if constraints.dtype not in (None, "bf16", "fp16", "fp32"):
        raise MedleyInputError(f"--dtype {constraints.dtype}: give bf16, fp16 or fp32 (or leave it out).")
    excluded = set(constraints.exclude_devices)
    kept = [d.type for i, d in enumerate(cluster.devices) if i not in excluded]
    check_precision(constraints.dtype or "", kept,
                    where="--dtype bf16",
                    fix="give --dtype fp16 or fp32, or leave those devices out with --exclude-devices.")
    if constraints.max_pp is not None and constraints.max_pp < 1:
        raise MedleyInputError(f"--max-pp {constraints.max_pp}: give at least 1.")
    devices = [d for d in range(cluster.num_devices) if d not in excluded]
    if not devices:
        raise MedleyInputError("--exclude-devices leaves no device to plan on; exclude fewer.")
    if objective not in ("throughput", "cost"):
        raise MedleyInputError(f"--objective {objective}: use 'throughput' or 'cost'.")
    if objective == "cost":
        unpriced = sorted(
            {cluster.devices[d].node for d in devices if cluster.devices[d].price_per_hour is None}
        )
        if unpriced:
            raise MedleyInputError(
                f"--objective cost needs a price for every device; nodes {unpriced} of cluster "
                f"'{cluster.name}' "
                "have no 'price_per_hour' (USD per device hour); set it in the cluster file."
            )
    sizes = constraints.micro_batch_sizes or MICRO_BATCH_SIZES
    if constraints.micro_batch_sizes and not any(global_batch % s == 0 for s in sizes):
        works = sorted(
            {v for s in sizes for v in (global_batch // s * s, (global_batch // s + 1) * s) if v > 0}
        )
        raise MedleyInputError(
            f"--global-batch {global_batch} is not a multiple of any allowed micro-batch size {list(sizes)}; "
            f"values that would work: {', '.join(map(str, works[:6]))}."
        )
    return devices


def device_pools(cluster: Cluster, devices: Sequence[int], estimator: Estimator) -> dict[str, list[int]]:
    """All devices, each device type alone, and the k fastest types for k = 2..T-1."""
    by_type = cluster.devices_by_type(devices)
    speed = {t: estimator.table(t, 1).total[-1] for t in by_type}
    ranked = sorted(by_type, key=lambda t: (speed[t], t))
    pools = {"all": list(devices)}
    for k in range(2, len(ranked)):
        pools["+".join(ranked[:k])] = sorted(d for t in ranked[:k] for d in by_type[t])
    if len(ranked) > 1:
        for t in ranked:
            pools[t] = by_type[t]
    return pools


@collector_paused()  # the search makes millions of small objects and no cycles worth finding
def search(
    cluster: Cluster,
    model: ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    cost: CostSource | None = None,
    objective: Objective = "throughput",
    top: int = 5,
    constraints: Constraints | None = None,
    baselines: bool = True,
    progress: Progress | None = None,
    simulate: int | None = None,
) -> SearchResult:
    """Plan ``model`` on ``cluster`` for ``global_batch`` sequences of ``seq_len`` tokens per step.

    Returns the ``top`` memory-feasible plans ranked by simulated throughput (or cost per token),
    the baselines' simulated figures and the aggregate bound. Raises :class:`MedleyInputError`
    naming the smallest memory shortfall when nothing fits. ``progress`` is told how far the
    estimates and the simulations are (a progress bar is the caller's to draw).
    """
    constraints = constraints or Constraints()
    devices = _check_inputs(cluster, model, global_batch, seq_len, constraints, objective)
    cost = cost or CatalogCostSource.for_cluster(model, cluster)
    estimator = Estimator(
        cluster,
        model,
        cost,
        seq_len=seq_len,
        global_batch=global_batch,
        memory_headroom=constraints.memory_headroom,
        dtype=constraints.dtype,
        adapter=constraints.adapter,
    )
    sizes = _usable_sizes(estimator, devices, constraints)
    pools = device_pools(cluster, devices, estimator)
    max_pp = constraints.max_pp or model.num_layers
    structures = list(estimator.structures(pools, max_pp=max_pp, micro_batch_sizes=sizes,
                                           allowed_tp=constraints.tp_degrees))
    candidates = _estimate(estimator, structures, constraints.schedules, progress)
    budget = simulate if simulate is not None else simulation_budget(len(devices), top)
    chosen, pool_best = choose(candidates, budget)
    within = ranking.SIMULATE_WITHIN if objective == "throughput" else None  # read at call time
    ranked = simulate_all(chosen + pool_best, model, seq_len, cluster, cost, constraints, progress,
                          within=within, always={c.key for c in pool_best}, pricing=estimator.pricing)
    feasible = _feasible(ranked, objective)
    if feasible:
        keys = {p.candidate.key for p in ranked}
        ranked += polish_leaders(feasible, estimator, cluster, cost, constraints, objective, keys)
    if constraints.asymmetric:
        seeds = [(mbs, tp) for mbs, tp in seeds_of([c for _, _, c in candidates])
                 if constraints.tp_degrees is None or tp in constraints.tp_degrees]
        leading = _feasible(ranked, objective)
        leaders = [p.plan.devices for p in leading[:GROUPED_FROM]]
        fastest = min((p.prediction.step_time_s for p in leading), default=float("inf"))
        if objective != "throughput":  # a slower plan can still be cheaper
            fastest = float("inf")
        grouped = grouped_candidates(estimator, partitions(estimator, devices, leaders), seeds,
                                     constraints.schedules, max_pp=max_pp, beat_s=fastest)
        ranked += simulate_grouped(grouped[:GROUPED_SIMULATED], model, seq_len, cluster, cost, constraints,
                                   progress, pricing=estimator.pricing)
    feasible = _feasible(ranked, objective)
    feasible = best_placement(feasible, top, cluster, cost, constraints, objective, pricing=estimator.pricing)
    if not feasible:
        raise shortfall_error(estimator, ranked, pools, constraints, global_batch, sizes)
    singles = [p for p in feasible if not p.plan.asymmetric
               and len({cluster.devices[d].type.name for d in p.plan.devices}) == 1]
    result = SearchResult(
        plans=feasible[:top],
        baselines={},
        aggregate_tokens_per_s=aggregate_bound(
            cluster, model, cost, seq_len=seq_len, micro_batch_sizes=sizes, devices=devices,
            adapter=constraints.adapter),
        objective=objective,
        cluster=cluster,
        model=model,
        cost=cost,
        pricing=estimator.pricing,
        global_batch=global_batch,
        seq_len=seq_len,
        constraints=constraints,
        simulated=ranked,
        estimated=[c for _, _, c in candidates],
        structures_estimated=len(structures),
        best_single_type=singles[0] if singles else None,
    )
    if baselines:
        result.baselines = run_baselines(estimator, devices, sizes, constraints)
        allowed = {name: p for name, p in result.baselines.items()
                   if p is not None and p.plan.layout.schedule in constraints.schedules}
        result.plans = _with_baselines(result.plans, allowed, top, objective)
    return result


def _feasible(ranked: list[RankedPlan], objective: Objective) -> list[RankedPlan]:
    """The plans that fit, best first (ties in simulation order)."""
    order = {id(p): i for i, p in enumerate(ranked)}
    return sorted((p for p in ranked if p.fits), key=lambda p: (objective_key(p, objective), order[id(p)]))


def _with_baselines(
    plans: list[RankedPlan], found: dict[str, RankedPlan | None], top: int, objective: Objective
) -> list[RankedPlan]:
    """The ranked plans with the baselines' plans that fit ranked among them: each baseline's space
    (cluster or type order, uniform or capacity split, equal micro-batches) is part of the
    planner's, so its simulated plan is a candidate too. The estimate-driven choice of finalists
    can miss such a plan (on small instances the estimate favours counts by speed where equal
    counts simulate faster); a plan taken this way keeps its baseline's pool name. Only plans of
    the schedule families the search may use are offered (baselines run their systems' own)."""
    seen = {(p.candidate.key, p.plan.shared.placement) for p in plans}
    merged = list(plans)
    for plan in found.values():
        if plan is not None and plan.fits and (plan.candidate.key, plan.plan.shared.placement) not in seen:
            seen.add((plan.candidate.key, plan.plan.shared.placement))
            merged.append(plan)
    order = sorted(range(len(merged)), key=lambda i: (objective_key(merged[i], objective), i))
    return [merged[i] for i in order][:top]


def _usable_sizes(estimator: Estimator, devices: Sequence[int], constraints: Constraints) -> tuple[int, ...]:
    """Micro-batch sizes that divide the global batch and that the cost source can answer for at
    least one device type (a measured profile may lack a size for some type: pools without that
    type still use it). When none is usable the cost source's own reason is raised (a profile
    measured at another sequence length, say)."""
    sizes = tuple(
        s for s in (constraints.micro_batch_sizes or MICRO_BATCH_SIZES) if estimator.global_batch % s == 0
    )
    types = sorted({estimator.cluster.devices[d].type.name for d in devices})
    usable, reason = [], None
    for size in sizes:
        for name in types:
            try:
                estimator.table(name, size)
            except MedleyInputError as err:
                reason = reason or err
                continue
            usable.append(size)
            break
    if not usable:
        if reason is not None:
            raise reason
        raise MedleyInputError(
            f"--global-batch {estimator.global_batch}: no micro-batch size among {list(sizes)} divides it; "
            "use a multiple of one of them."
        )
    return tuple(usable)


def family_variants(families: Sequence[str]) -> list[tuple[str, dict[str, int]]]:
    """Each allowed family with each value of its searched integer knob: interleaved's chunks
    per rank (2 or 4); hetero-1f1b's warm-up depths follow from the links (see candidates)."""
    out: list[tuple[str, dict[str, int]]] = []
    for family in families:
        if family == "interleaved":
            out += [(family, {"virtual_stages": v}) for v in INTERLEAVE_DEPTHS]
        else:
            out.append((family, {}))
    return out


def _estimate(
    estimator: Estimator, structures: list[Structure], families: Sequence[str], progress: Progress | None
) -> list[tuple[float, int, Candidate]]:
    """1F1B estimate of the structures in order of their bound (skipping those that cannot fit, and
    those whose bound, or failing that refined bound, cannot beat the ESTIMATE_RIVALS-th best
    estimate once their pool has POOL_ESTIMATES), then the allowed families of the
    EXPANDED_STRUCTURES most promising ones (and of POOL_ESTIMATES per pool)."""
    bounded = []
    structure_bound = StructureBounds(estimator)
    for index, st in enumerate(structures):
        try:
            bounded.append((structure_bound(st), index, st))
        except ProfileRangeError:  # a profile without this device type or micro-batch size
            continue
    bounded.sort(key=lambda x: (x[0], x[1]))
    base: list[tuple[float, int, Candidate]] = []
    estimates: list[float] = []  # base's estimates, sorted
    per_pool: dict[str, int] = {}
    for done, (bound, index, st) in enumerate(bounded, start=1):
        if progress is not None:
            progress("estimating structures", done, len(bounded))
        if bound == float("inf"):
            continue
        if (
            len(estimates) >= ESTIMATE_RIVALS
            and per_pool.get(st.pool, 0) >= POOL_ESTIMATES
            and (bound >= estimates[ESTIMATE_RIVALS - 1]
                 or structure_bound.refined(st) >= estimates[ESTIMATE_RIVALS - 1])
        ):
            continue
        try:
            candidate = estimator.candidate(st, "1f1b")
        except ProfileRangeError:
            continue
        if candidate is not None:
            base.append((candidate.estimate_s, index, candidate))
            insort(estimates, candidate.estimate_s)
            per_pool[st.pool] = per_pool.get(st.pool, 0) + 1
    base.sort(key=lambda x: (x[0], x[1]))
    keep: dict[int, Candidate] = {}
    kept_per_pool: dict[str, int] = {}
    for _, index, candidate in base:
        pool = candidate.structure.pool
        if len(keep) < EXPANDED_STRUCTURES or kept_per_pool.get(pool, 0) < POOL_ESTIMATES:
            keep[index] = candidate
            kept_per_pool[pool] = kept_per_pool.get(pool, 0) + 1
    out: list[tuple[float, int, Candidate]] = []
    variants = family_variants(families)
    for index, candidate in sorted(keep.items()):
        for f, (family, knobs) in enumerate(variants):
            if family != "1f1b" and candidate.structure.pp == 1:
                continue  # one stage: every family runs the same F, B, W sequence
            expanded = (
                candidate if family == "1f1b" else estimator.candidate(candidate.structure, family, **knobs)
            )
            if expanded is not None:
                out.append((expanded.estimate_s, index * len(variants) + f, expanded))
    out.sort(key=lambda x: (x[0], x[1]))
    return out
