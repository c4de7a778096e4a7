"""A reference search for small instances (at most :data:`MAX_DEVICES` devices): what the planner's
pruning loses, measured by a far larger search over the same simulator.

1. Every structure of the planner's space (every device pool, assignment strategy, pp and
   micro-batch size; no bound pruning) in every allowed schedule family, under every combination
   of the split rules (bottleneck sweep, uniform, by stage capacity), the micro-batch rules
   (balanced, by replica speed, equal) and both replicated ZeRO ladders, each estimated.
2. The :data:`SIMULATED` best by estimate, and the best of every (pool, family), simulated exactly
   under both ZeRO placements.
3. From the :data:`SEEDS` fastest that fit: where a seed's whole space of splits x memory options
   per stage has at most :data:`EXHAUSTIVE_LIMIT` members, every member is simulated; otherwise a
   local search over exact simulations moves one layer across a stage boundary, changes one
   stage's memory option to any other of the ladder, moves one micro-batch between replicas
   of different device types, or changes one pipeline rank's tp degree (its groups growing onto
   free devices of the same node and type, or shrinking), while that helps.

Step 1 covers every uniform tp degree and the per-type degrees the planner leaves out
(``mixed_tp``); per-rank degrees beyond those are reached only by step 3's local moves, so tp is
not enumerated exhaustively: what the reference measures is the loss from pruning, not an
optimality gap. The time is bounded by ``budget_s`` (step 3 stops when it is spent; ``complete`` says whether
it was). The planner's own result is not a seed: the reference can fail to match it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import combinations, product

from medley.cost.interfaces import CostSource
from medley.errors import MedleyInputError
from medley.schedule.zero_settings import Placement
from medley.search.estimate.bounds import memory_options
from medley.search.planner import device_pools, family_variants
from medley.search.rank.baselines import Scored, add_candidate
from medley.search.rank.ranking import RankedPlan, rank_plan
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.rules.candidates import Estimator
from medley.search.rules.tp_structures import tp_degrees
from medley.search.space import MICRO_BATCH_SIZES, Candidate, Constraints, MemoryOption, Structure
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec

MAX_DEVICES = 16
SIMULATED = 60
SEEDS = 5
EXHAUSTIVE_LIMIT = 400
"""Most splits x memory-option combinations of one seed that are enumerated whole."""
SPLIT_RULES = {
    "bottleneck": split_rules.bottleneck,
    "uniform": split_rules.uniform,
    "capacity": split_rules.by_stage_capacity,
}
MICRO_RULES = {
    "balanced": builder.balanced_micro_batches,
    "speed": builder.by_replica_speed,
    "equal": builder.equal_micro_batches,
}


@dataclass(kw_only=True)
class Reference:
    """What the reference search found.

    Attributes:
        best: its fastest plan that fits (None: none fits).
        estimated: candidates estimated; simulated: exact simulations run.
        enumerated: seeds whose whole split x memory-option space was simulated.
        complete: False when the time budget stopped the local search.
        seconds: wall seconds spent.
    """

    best: RankedPlan | None = None
    estimated: int = 0
    simulated: int = 0
    enumerated: int = 0
    complete: bool = True
    seconds: float = 0.0
    plans: dict[tuple[object, ...], RankedPlan | None] = field(default_factory=dict, repr=False)
    """Every candidate simulated (by key), with its faster placement that fits."""


def reference_search(
    cluster: Cluster,
    model: ModelSpec,
    *,
    global_batch: int,
    seq_len: int,
    cost: CostSource,
    constraints: Constraints | None = None,
    budget_s: float = 300.0,
) -> Reference:
    """The reference search of this module's docstring on an instance of at most MAX_DEVICES."""
    c = constraints or Constraints()
    devices = [d for d in range(cluster.num_devices) if d not in set(c.exclude_devices)]
    if len(devices) > MAX_DEVICES:
        raise MedleyInputError(
            f"--cluster: {len(devices)} devices; the reference search covers at most {MAX_DEVICES}."
        )
    start = time.perf_counter()
    deadline = start + budget_s
    est = Estimator(cluster, model, cost, seq_len=seq_len, global_batch=global_batch,
                    memory_headroom=c.memory_headroom, dtype=c.dtype, adapter=c.adapter)
    sizes = tuple(s for s in (c.micro_batch_sizes or MICRO_BATCH_SIZES) if global_batch % s == 0)
    pools = device_pools(cluster, devices, est)
    max_pp = min(c.max_pp or model.num_layers, model.num_layers)
    out = Reference()
    scored: Scored = []
    for st in est.structures(pools, max_pp=max_pp, micro_batch_sizes=sizes, mixed_tp=True,
                             allowed_tp=c.tp_degrees):
        for candidate in _candidates(est, st, c):
            scored.append((candidate.estimate_s, len(scored), candidate))
    out.estimated = len(scored)
    ranked = [p for p in (_simulate(est, c, out, cand) for cand in _finalists(scored)) if p is not None]
    seeds: dict[tuple[object, ...], RankedPlan] = {}
    for plan in sorted(ranked, key=lambda p: -p.tokens_per_s):
        seeds.setdefault(_space_key(plan.candidate), plan)
    for plan in list(seeds.values())[:SEEDS]:
        if time.perf_counter() > deadline:
            out.complete = False
            break
        _refine(est, c, out, plan.candidate, deadline, devices)
    out.seconds = time.perf_counter() - start
    return out


def _candidates(est: Estimator, st: Structure, c: Constraints) -> Iterator[Candidate]:
    """The structure's candidates under every combination of rules, per allowed family."""
    seen: set[tuple[object, ...]] = set()
    for level in (0, 1) if st.dp > 1 else (0,):
        for micro_name, split_name in product(MICRO_RULES, SPLIT_RULES):
            base: Scored = []
            add_candidate(base, lambda m=micro_name, sp=split_name, lv=level: _plain(
                est, st, "1f1b", m, sp, lv))
            for family, knobs in family_variants(c.schedules):
                made: Scored = []
                if family == "1f1b":
                    made = base
                elif family == "interleaved" and base:
                    chunks, counts = int(knobs["virtual_stages"]), base[0][2].micro_batches
                    add_candidate(made, lambda v=chunks, n=counts, sp=split_name, lv=level: _interleaved(
                        est, st, v, n, sp, lv))
                elif family != "interleaved" and st.pp > 1:
                    add_candidate(made, lambda f=family, m=micro_name, sp=split_name, lv=level: _plain(
                        est, st, f, m, sp, lv))
                for _, _, candidate in made:
                    if candidate.key not in seen:
                        seen.add(candidate.key)
                        yield candidate


def _plain(
    est: Estimator, st: Structure, family: str, micro: str, split: str, level: int
) -> Candidate | None:
    return builder.build(est, st, family, split=SPLIT_RULES[split], memory=memory_rules.cheapest_per_stage,
                         micro_batches=MICRO_RULES[micro](), replicated_level=level)


def _interleaved(
    est: Estimator, st: Structure, chunks: int, counts: tuple[int, ...], split: str, level: int
) -> Candidate | None:
    """Interleaved 1F1B on the 1F1B candidate's micro-batches: uniform chunks for the uniform
    rule, the time-only sweep over the chunks otherwise."""
    if st.pp < 2 or st.pp * chunks > est.model.num_layers:
        return None
    return builder.build(
        est, st, "interleaved",
        split=split_rules.uniform if split == "uniform" else split_rules.interleaved_chunks,
        memory=memory_rules.cheapest_per_rank, micro_batches=builder.given_micro_batches(counts),
        virtual_stages=chunks, replicated_level=level,
    )


def _finalists(scored: Scored) -> list[Candidate]:
    """The SIMULATED best by estimate and the best of every (pool, family)."""
    scored.sort(key=lambda x: (x[0], x[1]))
    chosen = {c.key: c for _, _, c in scored[:SIMULATED]}
    groups: set[tuple[str, str]] = set()
    for _, _, c in scored:
        if (c.structure.pool, c.family) not in groups:
            groups.add((c.structure.pool, c.family))
            chosen.setdefault(c.key, c)
    return list(chosen.values())


def _simulate(est: Estimator, c: Constraints, out: Reference, candidate: Candidate) -> RankedPlan | None:
    """The candidate's faster placement that fits (None: neither fits or the compiler refuses)."""
    if candidate.key in out.plans:
        return out.plans[candidate.key]
    best = None
    layout = candidate.layout(est.model, est.seq_len)
    for placement in (Placement.BUBBLE, Placement.NAIVE) if layout.dp > 1 else (Placement.BUBBLE,):
        try:
            ranked = rank_plan(candidate, replace(layout, placement=placement), est.cluster, est.cost,
                               c.memory_headroom, pricing=est.pricing)
        except ValueError:  # MedleyInputError included: a layout the compiler refuses
            continue
        out.simulated += 1
        if ranked.fits and (best is None or ranked.tokens_per_s > best.tokens_per_s):
            best = ranked
    out.plans[candidate.key] = best
    if best is not None and (out.best is None or best.tokens_per_s > out.best.tokens_per_s):
        out.best = best
    return best


def _space_key(candidate: Candidate) -> tuple[object, ...]:
    """What a seed's enumeration fixes: structure, family, knobs and micro-batches."""
    st = candidate.structure
    return (st.assignment, st.micro_batch_size, candidate.family, tuple(sorted(candidate.knobs)),
            candidate.micro_batches)


def _splits(layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    for cuts in combinations(range(1, layers), stages - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, layers), strict=True))


def _refine(
    est: Estimator, c: Constraints, out: Reference, seed: Candidate, deadline: float, devices: list[int]
) -> None:
    """Every split x option combination of the seed's space when it is small, else a local search."""
    stages = len(seed.stage_layers)
    ladder = memory_options(seed.structure.dp)
    size = math.comb(est.model.num_layers - 1, stages - 1) * len(ladder) ** stages
    if size <= EXHAUSTIVE_LIMIT:
        for split in _splits(est.model.num_layers, stages):
            for options in product(ladder, repeat=stages):
                if time.perf_counter() > deadline:
                    out.complete = False
                    return
                _simulate(est, c, out, replace(seed, stage_layers=split, options=options))
        out.enumerated += 1
        return
    current = _simulate(est, c, out, seed)
    while current is not None:
        better = None
        moves = [*_neighbours(est, current.candidate, ladder),
                 *tp_moves(est, current.candidate, devices, c)]
        for neighbour in moves:
            if time.perf_counter() > deadline:
                out.complete = False
                return
            plan = _simulate(est, c, out, neighbour)
            if plan is not None and plan.tokens_per_s > (better or current).tokens_per_s:
                better = plan
        current = better


def _neighbours(
    est: Estimator, candidate: Candidate, ladder: tuple[MemoryOption, ...]
) -> Iterator[Candidate]:
    """One layer across a boundary, one stage's memory option, one micro-batch from the busiest
    replica of one device-type signature to the idlest of another (not for hetero-1f1b, whose
    warm-up follows the counts)."""
    split, options = list(candidate.stage_layers), list(candidate.options)
    for b in range(len(split) - 1):
        for give, take in ((b, b + 1), (b + 1, b)):
            if split[give] > 1:
                moved = list(split)
                moved[give] -= 1
                moved[take] += 1
                yield replace(candidate, stage_layers=tuple(moved))
    for s in range(len(options)):
        for option in ladder:
            if option != options[s]:
                yield replace(candidate, options=tuple(options[:s] + [option] + options[s + 1:]))
    if candidate.family == "hetero-1f1b":
        return
    counts = list(candidate.micro_batches)
    groups = [members for _, members in est.signatures(candidate.structure)]
    for giver, taker in product(groups, repeat=2):
        a = max(giver, key=lambda r: (counts[r], -r))
        b = min(taker, key=lambda r: (counts[r], r))
        if a != b and counts[a] > 1:
            moved = list(counts)
            moved[a] -= 1
            moved[b] += 1
            yield replace(candidate, micro_batches=tuple(moved))


def tp_moves(
    est: Estimator, candidate: Candidate, devices: list[int], c: Constraints
) -> Iterator[Candidate]:
    """Every other tp degree of one pipeline rank whose groups stay valid: each replica's group
    starts at the same device and covers free devices of its node and type (shrinking always
    does); the split, options and micro-batches stay (the simulation checks memory)."""
    st = candidate.structure
    degrees = [t for t in tp_degrees(est, devices) if c.tp_degrees is None or t in c.tp_degrees]
    allowed = set(devices)
    for k in range(st.pp):
        others = {d for row in st.assignment for j, lead in enumerate(row) if j != k
                  for d in range(lead, lead + st.tp_of(j))}
        for t in degrees:
            free = allowed - others
            if t == st.tp_of(k) or not all(_group_free(est, row[k], t, free) for row in st.assignment):
                continue
            tp = tuple(t if j == k else st.tp_of(j) for j in range(st.pp))
            yield replace(candidate, structure=replace(st, tp=() if set(tp) == {1} else tp))


def _group_free(est: Estimator, lead: int, tp: int, free: set[int]) -> bool:
    """Devices lead .. lead+tp-1 are all free and on the lead's node, of its type."""
    group = range(lead, lead + tp)
    return all(d in free for d in group) and est.cluster.one_node_one_type(group)
