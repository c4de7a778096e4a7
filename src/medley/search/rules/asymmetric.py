"""The planner's replica groups of their own shape: the devices cut into groups (by type, say),
each with its own pipeline and its share of the global batch (the asymmetric replicas of
HexiScale / FlashFlex, Sailor's per-type shapes).

A plan of alike replicas cuts the model where its slowest replica must, so slow or small devices
slow every pipeline they join or stay out. Here each group (:mod:`medley.plan.segments`) takes its
own depth, split, schedule, memory options and micro-batch count on its devices. The groups share
what one plan shares: the micro-batch size, the precision, one TP degree (the layers they hold in
common meet in one ZeRO group per TP rank) and one ZeRO level (each layer's ZeRO group spans
every replica, so its holders need one level). Their gradients are synchronised over every
replica of the plan; the simulation times that on the links it uses.

Method, per partition of the devices (:func:`partitions`: by type; around the devices the best
symmetric plans leave idle; those plans' devices by type) and per (micro-batch size, TP degree)
seed (those of the best symmetric candidates, and no TP):

0. A partition whose gradient sync alone cannot finish within the fastest step simulated so far
   (:func:`sync_floor`: the model's gradients through the slowest link of a ring across its
   groups) is not planned: on clusters whose device types sit in different zones, none is.
1. For each ZeRO level of :data:`LEVELS`, each group's structures (the
   :class:`~medley.search.rules.candidates.Estimator`'s, on the group's devices, alike replicas) are built
   under that level alone, their estimated DP rings reaching one device of every other group
   (``Structure.sync_with``) and their state sharded over all replicas (``Structure.sync_dp``).
2. The batch is divided between the groups by speed and revised ``ROUNDS`` times: each group
   takes its share of micro-batches, its fastest structure at that count, and the next round gives
   each a share in proportion to the micro-batches per second it reached, so that the groups'
   steps even out. A group that cannot take a share joins the smallest other group.
3. Each group's structure is then built in every allowed schedule family and keeps its fastest.

The candidates are simulated like any other; the simulation, not the estimate, ranks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from medley.cost import formulas
from medley.cost.interfaces import Collective, ProfileRangeError
from medley.cost.zero_memory import state_bytes_per_param
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.rules.candidates import Estimator
from medley.search.space import Candidate, GroupedCandidate, Structure, distribute

ROUNDS = 3
"""Batch-division rounds (the shares settle within two or three)."""
SEEDS = 3
"""(micro-batch size, TP degree) pairs taken from the best symmetric candidates."""
INTERLEAVE_DEPTHS = (2, 4)
LEVELS = (0, 1, 3)
"""The plan-wide ZeRO levels tried (the planner's memory options: plain, ZeRO-1, streamed ZeRO-3)."""


def at_level(rule: builder.MemoryRule, level: int) -> builder.MemoryRule:
    """``rule`` over the options of ZeRO ``level`` alone (with and without recomputation): the
    groups' stages share one level (module doc, step 4)."""

    def restricted(setting: builder.Setting, split: tuple[int, ...]) -> builder.StagePlan | None:
        ladder = tuple(o for o in setting.ladder if o.level == level)
        return rule(replace(setting, ladder=ladder), split) if ladder else None

    return restricted


def _counts(total: int, dp: int) -> tuple[int, ...]:
    return tuple(total // dp + (1 if r < total % dp else 0) for r in range(dp))


class GroupPlanner:
    """Candidates of one group at one micro-batch size, TP degree and ZeRO level, by the group's
    micro-batch count (cached)."""

    def __init__(self, est: Estimator, pool: str, devices: list[int], *, tp: int, micro_batch_size: int,
                 max_pp: int, dtype: str, level: int, replicas_hint: int, others: tuple[int, ...]) -> None:
        self.est, self.dtype, self.level = est, dtype, level
        self.structures = [
            replace(st, sync_dp=max(st.dp, replicas_hint), sync_with=others)
            for st in est.structures({pool: devices}, max_pp=max_pp, micro_batch_sizes=(micro_batch_size,),
                                     allowed_tp=(tp,))
            if st.strategy != "replica-major"]  # alike replicas: the group's micro-batches spread evenly
        self._built: dict[tuple, Candidate | None] = {}

    def build(self, st: Structure, family: str, counts: tuple[int, ...],
              virtual_stages: int = 1) -> Candidate | None:
        key = (st, family, counts, virtual_stages)
        if key not in self._built:
            interleaved = family == "interleaved"
            memory = memory_rules.cheapest_per_rank if interleaved else memory_rules.cheapest_per_stage
            try:
                self._built[key] = builder.build(
                    self.est, st, family,
                    split=split_rules.interleaved_chunks if interleaved else split_rules.bottleneck,
                    memory=at_level(memory, self.level), micro_batches=builder.given_micro_batches(counts),
                    virtual_stages=virtual_stages if interleaved else 1, dtype=self.dtype)
            except ProfileRangeError:  # a profile without this device type or micro-batch size
                self._built[key] = None
        return self._built[key]

    def fastest(self, micro_batches: int) -> Candidate | None:
        """The group's fastest 1F1B candidate for ``micro_batches`` micro-batches in all."""
        best = None
        for st in self.structures:
            if st.dp > micro_batches:
                continue
            found = self.build(st, "1f1b", _counts(micro_batches, st.dp))
            if found is not None and (best is None or found.estimate_s < best.estimate_s):
                best = found
        return best

    def expanded(self, base: Candidate, families: Sequence[str]) -> Candidate | None:
        """``base``'s structure and micro-batches in each allowed family (one stage: 1F1B only,
        as every family runs the same there); the fastest by estimate, None when none is allowed."""
        st = base.structure
        best = base if "1f1b" in families else None
        for family in families:
            if family == "1f1b" or st.pp == 1:
                continue
            for depth in INTERLEAVE_DEPTHS if family == "interleaved" else (1,):
                if family == "interleaved" and st.pp * depth > self.est.model.num_layers:
                    continue
                found = self.build(st, family, base.micro_batches, depth)
                if found is not None and (best is None or found.estimate_s < best.estimate_s):
                    best = found
        return best


def sync_floor(est: Estimator, parts: dict[str, list[int]], dtype: str) -> float:
    """Seconds the gradient synchronisation of replica groups on ``parts`` takes at least: every
    layer's gradients are reduce-scattered over a ring through one device of each part, so the
    whole model's gradients cross its slowest link once per step (whatever the ZeRO level, the
    shapes or the overlap)."""
    model = est.model
    trained = formulas.stage_trained_params(model, est.adapter, 0, model.num_layers)
    grads = trained * state_bytes_per_param(dtype).grads
    ring = tuple(ids[0] for ids in parts.values())
    return est.comm.collective_time(Collective.REDUCE_SCATTER, ring, grads)


def grouped_candidates(est: Estimator, partitions: Sequence[dict[str, list[int]]],
                       seeds: Sequence[tuple[int, int]], families: Sequence[str], *,
                       max_pp: int, beat_s: float = float("inf")) -> list[GroupedCandidate]:
    """The fastest grouped candidate (over the ZeRO levels) of each partition of the devices
    (name -> devices; :func:`partitions`) and seed (micro-batch size, TP degree), fastest estimate
    first (module doc). A partition whose :func:`sync_floor` is not below ``beat_s`` (the fastest
    step simulated so far) cannot win and is not planned."""
    if est.model.tied_embeddings:  # not run by the runtime with replica groups (medley.runtime.setup)
        return []
    devices = sorted(d for part in partitions[0].values() for d in part) if partitions else []
    dtype = est.dtype((tuple(devices),))
    out = []
    for parts in partitions:
        if sync_floor(est, parts, dtype) >= beat_s:
            continue
        for mbs, tp in dict.fromkeys(seeds):
            if est.global_batch % mbs or len(parts) < 2:
                continue
            found = [c for level in LEVELS
                     if (c := _grouped(est, dict(parts), mbs, tp, families, max_pp=max_pp, dtype=dtype,
                                       level=level)) is not None]
            if found:
                out.append(min(found, key=lambda c: c.estimate_s))
    return sorted(out, key=lambda c: c.estimate_s)


def partitions(est: Estimator, devices: Sequence[int],
               used: Sequence[Sequence[int]] = ()) -> list[dict[str, list[int]]]:
    """Ways to cut ``devices`` into replica groups: one group per device type; and for each
    device set in ``used`` (the best symmetric plans' devices): that set as one group (its
    pipelines may mix types) with the devices it leaves idle grouped by type, and that set alone
    cut by type."""
    by_type = est.cluster.devices_by_type(devices)
    out = [dict(by_type)] if len(by_type) > 1 else []
    for held in used:
        idle = sorted(set(devices) - set(held))
        if idle:
            out.append({"used": sorted(held), **{f"idle {t}": ids
                                                  for t, ids in est.cluster.devices_by_type(idle).items()}})
            inside = est.cluster.devices_by_type(held)
            if len(inside) > 1:
                out.append(inside)
    return [parts for i, parts in enumerate(out) if parts not in out[:i]]


def _grouped(est: Estimator, parts: dict[str, list[int]], mbs: int, tp: int, families: Sequence[str], *,
             max_pp: int, dtype: str, level: int) -> GroupedCandidate | None:
    """The grouped candidate of a partition of the devices (``parts``: name -> devices) at one
    ZeRO level, its parts merged into the fastest while one cannot take its share; None when
    fewer than two remain."""
    total = est.global_batch // mbs
    while len(parts) > 1 and total >= len(parts):
        speed = {name: sum(1.0 / est.table(est.type_names[d], mbs, dtype, 1).total[-1] for d in ids)
                 for name, ids in parts.items()}
        hint = max(2, len(parts))
        planners = {name: GroupPlanner(est, name, ids, tp=tp, micro_batch_size=mbs, max_pp=max_pp,
                                       dtype=dtype, level=level, replicas_hint=hint,
                                       others=tuple(other[0] for n, other in parts.items() if n != name))
                    for name, ids in parts.items()}
        names = list(parts)
        shares = distribute(total, [speed[n] for n in names])
        found = _balanced(planners, names, shares, total)
        if isinstance(found, str):  # that part cannot take a share: it joins the smallest other part
            other = min((n for n in names if n != found), key=lambda n: (len(parts[n]), -speed[n]))
            merged = sorted(parts.pop(found) + parts.pop(other))
            parts = {**parts, f"{other}+{found}": merged}
            continue
        chosen = [planners[name].expanded(found[name], families) for name in names]
        if any(c is None for c in chosen):
            return None
        parts = tuple(c for c in chosen if c is not None)
        return GroupedCandidate(parts=parts, estimate_s=max(p.estimate_s for p in parts), dtype=dtype)
    return None


def _balanced(planners: dict[str, GroupPlanner], names: list[str], shares: tuple[int, ...],
              total: int) -> dict[str, Candidate] | str:
    """Each part's fastest candidate for its share, the shares revised by the speed each reached
    (``ROUNDS`` times; the round with the fastest slowest part wins), or the name of a part that
    has no candidate for its share."""
    best: tuple[float, dict[str, Candidate]] | None = None
    for _ in range(ROUNDS):
        chosen: dict[str, Candidate] = {}
        for name, share in zip(names, shares, strict=True):
            found = planners[name].fastest(share)
            if found is None:
                return name
            chosen[name] = found
        step = max(c.estimate_s for c in chosen.values())
        if best is None or step < best[0]:
            best = (step, chosen)
        rates = [share / chosen[name].estimate_s for name, share in zip(names, shares, strict=True)]
        new = distribute(total, rates)
        if new == shares:
            break
        shares = new
    assert best is not None
    return best[1]


def seeds_of(candidates: Sequence[Candidate], count: int = SEEDS) -> list[tuple[int, int]]:
    """The (micro-batch size, uniform TP degree) of the best ``count`` symmetric candidates that
    have one degree, and (their micro-batch size, no TP)."""
    out: list[tuple[int, int]] = []
    for candidate in candidates:
        st = candidate.structure
        degrees = set(st.tp) or {1}
        if len(degrees) == 1:
            out.append((st.micro_batch_size, degrees.pop()))
        out.append((st.micro_batch_size, 1))
        if len(dict.fromkeys(out)) >= count:
            break
    return list(dict.fromkeys(out))[:count]

