"""Building the planner's candidates: structures over device pools, then split, memory options and an
analytic estimate per schedule family (exact figures come from the simulator; the data types live
in :mod:`medley.plan.space`).

A *structure* fixes the devices and their roles: a pool of devices (all of them, one device type,
or the k fastest types), pp x dp, an assignment strategy and the micro-batch size. Strategies:

* ``stage-major`` (HyperPipe's grouping): devices sorted fastest type first, in cluster (node)
  order; pipeline rank k's DP group is the k-th run of dp devices. DP groups, which carry the
  ZeRO collectives, stay inside a node where they can; the pipeline crosses the slow links.
* ``memory-first``: the same with the types sorted by memory, largest first (stage 0 holds the
  most in-flight activations and the embedding).
* ``replica-major``: replica r is the r-th run of pp devices, so each replica sits on one type
  (and node) where it can; replicas then differ and get micro-batch counts by speed.

:class:`Estimator` turns a structure into a :class:`Candidate` for a schedule family: micro-batches
per replica in proportion to replica speed, the layer split from the bottleneck sweep under each
device's memory, the cheapest memory option per stage that fits, and an estimated step time.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import CostSource
from medley.plan.bounds import (
    Flight,
    LayerTable,
    bottleneck_split,
    layer_table,
    memory_options,
    memory_prefix,
    stage_memory,
)
from medley.plan.space import (
    LARGE_POOL,
    PP_CHOICES,
    PP_CHOICES_LARGE,
    Candidate,
    Structure,
    distribute,
)
from medley.plan.step_estimate import interleaved_candidate, step_estimate
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec


class Estimator:
    """Analytic planning over one cluster, model and cost source (tables and groups cached)."""

    def __init__(
        self,
        cluster: Cluster,
        model: ModelSpec,
        cost: CostSource,
        *,
        seq_len: int,
        global_batch: int,
        memory_headroom: float,
    ) -> None:
        self.cluster, self.model, self.cost = cluster, model, cost
        self.seq_len, self.global_batch = seq_len, global_batch
        self.headroom = memory_headroom
        self.comm = TopologyCommModel(cluster)
        self._tables: dict[tuple[str, int, str], LayerTable] = {}
        self._memory_prefixes: dict[tuple, tuple[float, ...]] = {}

    # --- building blocks -------------------------------------------------------------------
    def table(self, device_type: str, mbs: int, dtype: str = "bf16") -> LayerTable:
        key = (device_type, mbs, dtype)
        if key not in self._tables:
            self._tables[key] = layer_table(
                self.model,
                self.cost,
                device_type=device_type,
                micro_batch_size=mbs,
                seq_len=self.seq_len,
                dtype=dtype,
            )
        return self._tables[key]

    def capacity(self, device: int) -> float:
        return self.cluster.devices[device].type.memory_bytes * (1.0 - self.headroom)

    def dtype(self, assignment: tuple[tuple[int, ...], ...]) -> str:
        types = {self.cluster.devices[d].type for row in assignment for d in row}
        return "bf16" if all(t.supports_bf16 for t in types) else "fp16"

    def boundary_time(self, a: int, b: int, mbs: int) -> float:
        nbytes = formulas.boundary_bytes(self.model, micro_batch_size=mbs, seq_len=self.seq_len)
        return self.comm.p2p_time(a, b, nbytes)

    # --- structures -------------------------------------------------------------------------
    def assign(self, order: Sequence[int], pp: int, dp: int, strategy: str) -> tuple[tuple[int, ...], ...]:
        used = list(order[: pp * dp])
        if strategy == "replica-major":
            return tuple(tuple(used[r * pp + k] for k in range(pp)) for r in range(dp))
        return tuple(tuple(used[k * dp + r] for k in range(pp)) for r in range(dp))

    def structures(
        self,
        pools: dict[str, list[int]],
        *,
        max_pp: int,
        micro_batch_sizes: Sequence[int],
    ) -> Iterator[Structure]:
        """Every (pool, strategy, pp, dp, micro-batch size) worth estimating, in a fixed order."""
        for pool_name, devices in pools.items():
            orders = self._orders(devices)
            for pp in PP_CHOICES if len(devices) <= LARGE_POOL else PP_CHOICES_LARGE:
                if pp > min(max_pp, len(devices), self.model.num_layers):
                    break
                for mbs in micro_batch_sizes:
                    if self.global_batch % mbs:
                        continue
                    dp = min(len(devices) // pp, self.global_batch // mbs)
                    if dp < 1:
                        continue
                    seen = set()
                    for strategy, order in orders.items():
                        if strategy == "replica-major" and (pp == 1 or dp == 1):
                            continue
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
                        )

    def _orders(self, devices: list[int]) -> dict[str, list[int]]:
        types = {self.cluster.devices[d].type for d in devices}
        speed = {t.name: self.table(t.name, 1).total[-1] for t in types}
        by_speed = sorted(devices, key=lambda d: (speed[self.cluster.devices[d].type.name], d))
        by_memory = sorted(
            devices,
            key=lambda d: (
                -self.cluster.devices[d].type.memory_bytes,
                speed[self.cluster.devices[d].type.name],
                d,
            ),
        )
        orders = {"stage-major": by_speed}
        if by_memory != by_speed:
            orders["memory-first"] = by_memory
        orders["replica-major"] = by_speed
        return orders

    # --- one structure, one family -------------------------------------------------------------
    def candidate(self, st: Structure, family: str, *, virtual_stages: int = 2) -> Candidate | None:
        """The family's best split/options/micro-batches for ``st``, or None if it cannot fit."""
        if family == "interleaved":
            return self._interleaved(st, virtual_stages)
        dtype = self.dtype(st.assignment)
        mbs = st.micro_batch_size
        total_mb = self.global_batch // mbs
        signatures = self._signatures(st)
        # Start from speeds of whole-model time, then rebalance once from the split's bottlenecks.
        weights = [1.0 / sum(self.table(t, mbs).total[-1] for t in sig) for sig, _ in signatures]
        micro_batches = self._micro_batches(st, signatures, weights, total_mb)
        result = None
        for _ in range(2):
            counts = [micro_batches[members[0]] for _, members in signatures]
            depth = self._depths(st, family, max(counts), signatures)
            if depth is None:
                return None
            flights = self.flights(family, depth, max(counts))
            result = self._split(st, signatures, counts, flights, dtype, st.pp)
            if result is None:
                return None
            split, options = result
            bottlenecks = [
                max(self._stage_time(sig[s], split, s, options[s], mbs) for s in range(st.pp))
                for sig, _ in signatures
            ]
            new = self._micro_batches(st, signatures, [1.0 / b for b in bottlenecks], total_mb)
            if new == micro_batches:
                break
            micro_batches = new
        assert result is not None
        split, options = result
        knobs = {}
        if family == "hetero-1f1b":
            counts = [micro_batches[members[0]] for _, members in signatures]
            warmup = self._depths(st, family, max(counts), signatures)
            knobs = {"warmup": list(warmup)}
        estimate = self.estimate(st, family, split, options, micro_batches, signatures)
        return Candidate(
            structure=st,
            family=family,
            knobs=knobs,
            micro_batches=micro_batches,
            stage_layers=split,
            options=options,
            estimate_s=estimate,
            dtype=dtype,
        )

    def _signatures(self, st: Structure) -> list[tuple[tuple[str, ...], list[int]]]:
        """Replicas grouped by the device types of their ranks (identical replicas share estimates)."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for r, row in enumerate(st.assignment):
            groups.setdefault(tuple(self.cluster.devices[d].type.name for d in row), []).append(r)
        return list(groups.items())

    def _micro_batches(self, st, signatures, weights, total_mb) -> tuple[int, ...]:
        per_replica = [0.0] * st.dp
        for (_, members), w in zip(signatures, weights, strict=True):
            for r in members:
                per_replica[r] = w
        return distribute(total_mb, per_replica)

    def _depths(self, st: Structure, family: str, m: int, signatures) -> tuple[int, ...] | None:
        """Warm-up depth per stage; hetero-1f1b deepens it before slow links (HARP's launch
        micro-batches: +1 per boundary, +1..3 across nodes by the transfer's share of a stage's
        time). None when hetero-1f1b would equal 1F1B."""
        pp = st.pp
        if family == "gpipe":
            return (m,) * pp
        base = tuple(min(pp - s, m) for s in range(pp))
        if family != "hetero-1f1b":
            return base
        mbs = st.micro_batch_size
        t_stage = max(self.table(t, mbs).total[-1] for sig, _ in signatures for t in sig) / pp
        depths = [1] * pp
        for s in range(pp - 2, -1, -1):
            link = max(self.boundary_time(r[s], r[s + 1], mbs) for r in st.assignment)
            same_node = all(
                self.cluster.devices[r[s]].node == self.cluster.devices[r[s + 1]].node for r in st.assignment
            )
            step = 1 if same_node else (1 if link < t_stage / 10 else 2 if link < t_stage / 2 else 3)
            depths[s] = depths[s + 1] + step
        clipped = tuple(min(d, m) for d in depths)
        return None if clipped == base else clipped

    @staticmethod
    def flights(family: str, depths: Sequence[int], m: int) -> list[Flight]:
        """Peak in-flight micro-batches per stage: zero-bubble schedules also hold the B-to-W
        tensors of the weight gradients they defer (stage s defers s of them)."""
        if family == "zb-h1":
            return [Flight(full=d, after_b=min(s, m)) for s, d in enumerate(depths)]
        return [Flight(full=d) for d in depths]

    def _split(self, st, signatures, counts, depth, dtype, num_stages):
        """Bottleneck split over ``num_stages`` stages with the cheapest options that fit."""
        mbs, pp, dp = st.micro_batch_size, st.pp, st.dp
        stage_types = [
            sorted({(sig[s], c) for (sig, _), c in zip(signatures, counts, strict=True)}) for s in range(pp)
        ]
        types = self.cluster.device_types()
        caps = {t: types[t].memory_bytes * (1.0 - self.headroom) for sig, _ in signatures for t in sig}
        ladder = memory_options(dp)
        num_layers = self.model.num_layers
        slowest = max(
            self.table(t, mbs).time(0, num_layers, recompute=True) * c
            for s in range(pp)
            for t, c in stage_types[s]
        )
        for allowed in (ladder[:1], ladder):
            # Per stage and option: (option, [(time prefix, micro-batches, memory prefix, capacity, table)]),
            # so that a probe is a few bisections.
            plans = [
                [
                    (
                        option,
                        [
                            (
                                self.table(t, mbs, dtype).total_rc
                                if option.recompute
                                else self.table(t, mbs, dtype).total,
                                c,
                                self._prefix(t, mbs, dtype, option, dp, depth[s]),
                                caps[t],
                                self.table(t, mbs, dtype),
                            )
                            for t, c in stage_types[s]
                        ],
                    )
                    for option in allowed
                ]
                for s in range(pp)
            ]

            def stage_end(s: int, i: int, t: float, plans=plans) -> int:
                best = i
                for option, items in plans[s]:
                    end = num_layers
                    for times, c, memory, cap, _ in items:
                        end = min(
                            end,
                            bisect_right(times, times[i] + t / c) - 1,
                            bisect_right(memory, memory[i] + cap) - 1,
                        )
                    if option.streams and end - i < option.buckets:  # short stages gather a larger share
                        for _, _, _, cap, table in items:
                            while (
                                end > i
                                and stage_memory(table, i, end, option=option, dp=dp, in_flight=depth[s])
                                > cap
                            ):
                                end -= 1
                    best = max(best, end)
                return best

            # The continuous optimum (stage s takes the share of the model its speed allows) is a
            # lower bound on the bottleneck; the split is rarely more than a few layers' time above it.
            ideal = 1.0 / sum(
                1.0 / max(self.table(t, mbs).total[-1] * c for t, c in stage_types[s]) for s in range(pp)
            )
            found = bottleneck_split(
                num_layers,
                num_stages,
                stage_end,
                lo=ideal * 0.999,
                hi=ideal * 1.5,
                fallback_hi=slowest * 1.0001,
            )
            if found is None:
                continue
            split, _ = found
            options = []
            start = 0
            for s, n in enumerate(split):
                fit = next(
                    (
                        o
                        for o in ladder
                        if all(
                            stage_memory(
                                self.table(t, mbs, dtype),
                                start,
                                start + n,
                                option=o,
                                dp=dp,
                                in_flight=depth[s],
                            )
                            <= caps[t]
                            for t, _ in stage_types[s]
                        )
                    ),
                    None,
                )
                if fit is None:
                    return None
                options.append(fit)
                start += n
            return split, tuple(options)
        return None

    def _prefix(self, device_type, mbs, dtype, option, dp, flight) -> tuple[float, ...]:
        key = (device_type, mbs, option, dp, flight)
        prefix = self._memory_prefixes.get(key)
        if prefix is None:
            table = self.table(device_type, mbs, dtype)
            prefix = self._memory_prefixes[key] = memory_prefix(table, option=option, dp=dp, flight=flight)
        return prefix

    def _stage_time(self, device_type: str, split, s, option, mbs) -> float:
        start = sum(split[:s])
        return self.table(device_type, mbs).time(start, start + split[s], recompute=option.recompute)

    def estimate(
        self, st, family, split, options, micro_batches, signatures, virtual_stages: int = 1
    ) -> float:
        """Estimated step seconds (:func:`medley.plan.step_estimate.step_estimate`)."""
        return step_estimate(self, st, family, split, options, micro_batches, signatures, virtual_stages)

    def _interleaved(self, st: Structure, v: int) -> Candidate | None:
        return interleaved_candidate(self, st, v)
