"""Building the planner's candidates: structures over device pools, then split, memory options and an
analytic estimate per schedule family (exact figures come from the simulator; the data types live
in :mod:`medley.search.space`).

A *structure* fixes the devices and their roles: a pool of devices (all of them, one device type,
or the k fastest types), pp x dp, an assignment strategy and the micro-batch size. Strategies:

* ``stage-major`` (HyperPipe's grouping): devices sorted fastest type first, in cluster (node)
  order; pipeline rank k's DP group is the k-th run of dp devices. DP groups, which carry the
  ZeRO collectives, stay inside a node where they can; the pipeline crosses the slow links.
* ``memory-first``: the same with the types sorted by memory, largest first (stage 0 holds the
  most in-flight activations and the embedding).
* ``slowest-first`` (pools of several types, pp > 1): the fastest pp x dp devices of the pool,
  grouped as in ``stage-major`` but the slowest type first (one of the type orders Metis
  searches): the fast devices, which take the most layers, and the head then sit on the last
  ranks, which hold the fewest micro-batches in flight. Where memory binds they can then run
  without the recomputation fastest-first needs (LLaMA-2-70B on the planner bench's 1,024 devices:
  ``bench/results/planner.md``).
* ``replica-major``: replica r is the r-th run of pp devices, so each replica sits on one type
  (and node) where it can; replicas then differ and get micro-batch counts by speed.

:class:`Estimator` turns a structure into a :class:`Candidate` for a schedule family with
:func:`medley.search.rules.builder.build`: micro-batches per replica in proportion to replica speed, the
layer split from the bottleneck sweep under each device's memory, the cheapest memory option per
stage that fits, and an estimated step time (interleaved 1F1B: the 1F1B candidate's micro-batches,
a time-only split over the chunks, one memory option per rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

from medley.search.estimate.context import PlanContext
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.rules.tp_structures import mixed_structures, tp_degrees, tp_groups
from medley.search.space import LARGE_POOL, PP_CHOICES, PP_CHOICES_LARGE, Candidate, Structure


class Estimator(PlanContext):
    """The planner's structures and their candidates over one cluster, model and cost source."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._one_f_one_b: dict[tuple[Structure, int], Candidate | None] = {}

    def structures(
        self,
        pools: dict[str, list[int]],
        *,
        max_pp: int,
        micro_batch_sizes: Sequence[int],
        mixed_tp: bool = False,
        allowed_tp: Sequence[int] | None = None,
    ) -> Iterator[Structure]:
        """Every (pool, tp, strategy, pp, dp, micro-batch size) worth estimating, in a fixed order.

        With ``tp`` > 1 every pipeline rank runs on a TP group of tp consecutive devices of one
        node and type (:func:`~medley.search.rules.tp_structures.tp_groups`); the strategies order the
        groups as they order devices. With ``mixed_tp``, mixed pools also get structures whose
        degree grows on the slower types (:func:`~medley.search.rules.tp_structures.mixed_structures`);
        the search leaves them out: the analytic estimate is optimistic for them (their pipeline
        transfers queue behind DP collectives on the node networks), so on 1,024 devices they
        crowded the few exact simulations out (fraction of the bound 0.42 against 0.50 without),
        and on the mid-size mixed cases measured they never won. ``allowed_tp`` (None: all) limits
        the degrees (:attr:`~medley.search.space.Constraints.tp_degrees`)."""
        for pool_name, devices in pools.items():
            for tp in tp_degrees(self, devices):
                if allowed_tp is None or tp in allowed_tp:
                    yield from self._structures(pool_name, devices, tp, max_pp, micro_batch_sizes)
            if mixed_tp and allowed_tp is None:
                yield from mixed_structures(self, pool_name, devices, max_pp=max_pp,
                                            micro_batch_sizes=micro_batch_sizes)

    def _structures(
        self, pool_name: str, devices: list[int], tp: int, max_pp: int, micro_batch_sizes: Sequence[int]
    ) -> Iterator[Structure]:
        units = tp_groups(self, devices, tp)
        seconds = {d: self._step_seconds(d) for d in units}
        orders = self._orders(units, seconds)
        for pp in PP_CHOICES if len(devices) <= LARGE_POOL else PP_CHOICES_LARGE:
            if pp > min(max_pp, len(units), self.model.num_layers):
                break
            for mbs in micro_batch_sizes:
                if self.global_batch % mbs:
                    continue
                dp = min(len(units) // pp, self.global_batch // mbs)
                if dp < 1:
                    continue
                seen = set()
                for strategy, order in orders.items():
                    if strategy == "replica-major" and (pp == 1 or dp == 1):
                        continue
                    if strategy == "slowest-first":
                        if pp == 1:
                            continue  # replicas of one rank: only their order would change
                        order = _slowest_first(order[: pp * dp], seconds)
                    assignment = self.assign(order, pp, dp, strategy)
                    if assignment in seen:
                        continue
                    seen.add(assignment)
                    yield Structure(
                        pool=pool_name,
                        strategy=strategy,
                        pp=pp,
                        dp=dp,
                        assignment=assignment,
                        micro_batch_size=mbs,
                        tp=(tp,) * pp if tp > 1 else (),
                    )

    def _orders(self, devices: list[int], seconds: dict[int, float]) -> dict[str, list[int]]:
        """The device order of each strategy (see the module docstring; ties by device id), from
        each device's :meth:`_step_seconds`. The ``slowest-first`` entry lists the devices fastest
        first: a structure takes its fastest pp x dp and reorders them (:func:`_slowest_first`)."""
        types = {self.cluster.devices[d].type for d in devices}
        by_speed = sorted(devices, key=lambda d: (seconds[d], d))
        memory = {d: self.cluster.devices[d].type.memory_bytes for d in devices}
        by_memory = sorted(devices, key=lambda d: (-memory[d], seconds[d], d))
        orders = {"stage-major": by_speed}
        if by_memory != by_speed:
            orders["memory-first"] = by_memory
        if len(types) > 1:
            orders["slowest-first"] = by_speed
        orders["replica-major"] = by_speed
        return orders

    def _step_seconds(self, device: int) -> float:
        """One micro-batch of one sequence through the whole model on ``device``'s type."""
        return self.table(self.cluster.devices[device].type.name, 1).total[-1]

    # --- one structure, one family -------------------------------------------------------------
    def candidate(self, st: Structure, family: str, *, virtual_stages: int = 2) -> Candidate | None:
        """The family's best split/options/micro-batches for ``st``, or None if it cannot fit."""
        if family == "interleaved" and (st.pp < 2 or st.pp * virtual_stages > self.model.num_layers):
            return None
        best: Candidate | None = None
        for level in (0, 1) if st.dp > 1 else (0,):  # replicated stages: plain state or ZeRO-1
            candidate = self._candidate(st, family, virtual_stages, level)
            if candidate is not None and (best is None or candidate.estimate_s < best.estimate_s):
                best = candidate
        return best

    def _candidate(self, st: Structure, family: str, virtual_stages: int, level: int) -> Candidate | None:
        if family == "interleaved":
            base = self._candidate(st, "1f1b", virtual_stages, level)
            if base is None:
                return None
            return builder.build(
                self, st, family, split=split_rules.interleaved_chunks, memory=memory_rules.cheapest_per_rank,
                micro_batches=builder.given_micro_batches(base.micro_batches), virtual_stages=virtual_stages,
                replicated_level=level,
            )
        if family != "1f1b":
            return self._swept(st, family, level)
        # Built once per structure and level: the first pass estimates it, each interleaved depth
        # starts from it (the build is deterministic).
        key = (st, level)
        if key not in self._one_f_one_b:
            self._one_f_one_b[key] = self._swept(st, family, level)
        return self._one_f_one_b[key]

    def _swept(self, st: Structure, family: str, level: int) -> Candidate | None:
        return builder.build(
            self, st, family, split=split_rules.bottleneck, memory=memory_rules.cheapest_per_stage,
            micro_batches=builder.balanced_micro_batches(), replicated_level=level,
        )


def _slowest_first(fastest_first: list[int], seconds: dict[int, float]) -> list[int]:
    """``fastest_first`` (sorted by step seconds, then id) with its runs of equal step time in
    reverse order: the slowest first, ids still ascending within a run (no sort per structure)."""
    runs = [list(run) for _, run in groupby(fastest_first, key=seconds.__getitem__)]
    return [d for run in reversed(runs) for d in run]
