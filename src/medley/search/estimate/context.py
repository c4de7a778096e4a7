"""What every planner step reads: one cluster, model and cost source, with the per device type
layer tables (:class:`~medley.search.estimate.layer_table.LayerTable`) and memory prefixes cached.

:class:`PlanContext` is the lowest module of the planner core: the step estimate, the candidate
builder and the structure enumeration (:class:`~medley.search.rules.candidates.Estimator`) all take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import CostSource
from medley.cost.tp_cost import TensorPricing
from medley.lowering.tp_links import hop_bytes_factor
from medley.search.estimate.bounds import Flight, memory_prefix
from medley.search.estimate.layer_table import LayerTable, layer_table
from medley.search.space import MemoryOption, Structure, distribute
from medley.spec.adapter import LoraSpec
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec

Assignment = tuple[tuple[int, ...], ...]
"""``assignment[r][k]``: the global device id of replica r's pipeline rank k."""

Signatures = list[tuple[tuple[str, ...], list[int]]]
"""Replicas grouped by the device types of their ranks: (types per rank, replica indices)."""


class PlanContext:
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
        dtype: str | None = None,
        adapter: LoraSpec | None = None,
    ) -> None:
        self.cluster, self.model, self.cost = cluster, model, cost
        self.adapter = adapter  # LoRA adapters every plan trains, the base frozen (None: full training)
        self.forced_dtype = dtype
        self.seq_len, self.global_batch = seq_len, global_batch
        self.headroom = memory_headroom
        self.comm = TopologyCommModel(cluster)
        self._tables: dict[tuple[str, int, str, int], LayerTable] = {}
        self._memory_ends: dict[tuple, np.ndarray] = {}
        self.pricing = TensorPricing(model, cost, cluster)  # TP pricing of every table and simulation
        self.network_loads: dict[tuple, float] = {}  # step_estimate.network_load's, per structure
        self.dp_groups: dict[tuple, list] = {}  # step_estimate.dp_groups', per structure
        self.link_users: dict[tuple, list] = {}  # step_estimate.link_users', per structure
        self.sweep_memory: dict[tuple, Any] = {}  # sweep.StageEnds' memory limits, per stage setting
        self.device_types = cluster.device_types()
        self.type_names = [device.type.name for device in cluster.devices]  # by device id
        self._no_bf16 = [not device.type.supports_bf16 for device in cluster.devices]

    def table(self, device_type: str, mbs: int, dtype: str = "bf16", tp: int = 1) -> LayerTable:
        """One TP rank's layer table at degree ``tp`` (its all-reduces timed on a group of
        ``tp`` devices of the type on one node, :meth:`tp_group`)."""
        key = (device_type, mbs, dtype, tp)
        found = self._tables.get(key)
        if found is not None:
            return found
        found = self._tables[key] = layer_table(
            self.model,
            self.cost,
            device_type=device_type,
            micro_batch_size=mbs,
            seq_len=self.seq_len,
            dtype=dtype,
            tp=tp,
            tensor=self.pricing.of(dtype),
            comm=self.comm,
            group=self.tp_group(device_type, tp),
            adapter=self.adapter,
        )
        return found

    def tp_group(self, device_type: str, tp: int) -> tuple[int, ...]:
        """``tp`` devices of ``device_type`` on one node (the first node with that many), whose
        link times a TP group's all-reduces in the tables; () when tp is 1 or no node has them."""
        if tp == 1:
            return ()
        for node in self.cluster.nodes:
            ids = [d for d in node.device_ids if self.cluster.devices[d].type.name == device_type]
            if len(ids) >= tp:
                return tuple(ids[:tp])
        return ()

    def capacity(self, device: int) -> float:
        return self.type_capacity(self.type_names[device])

    def type_capacity(self, device_type: str) -> float:
        """Bytes a device of ``device_type`` may fill (its memory less the headroom)."""
        return self.device_types[device_type].memory_bytes * (1.0 - self.headroom)

    def dtype(self, assignment: Assignment) -> str:
        """The precision ``assignment`` trains in: the search's ``dtype`` when one was given, else
        :func:`medley.spec.catalog.half_precision` of its devices (per-device flags: the search
        asks this for every structure)."""
        if self.forced_dtype is not None:
            return self.forced_dtype
        no_bf16 = self._no_bf16.__getitem__
        return "fp16" if any(map(no_bf16, chain.from_iterable(assignment))) else "bf16"

    def boundary_time(self, a: int, b: int, mbs: int, tp_a: int = 1, tp_b: int = 1) -> float:
        """One pipeline transfer from the group of ``tp_a`` devices at ``a`` to that of ``tp_b``
        at ``b`` (the busiest link's bytes, :func:`medley.lowering.tp_links.hop_bytes_factor`)."""
        nbytes = formulas.boundary_bytes(self.model, micro_batch_size=mbs, seq_len=self.seq_len)
        if tp_a > 1 or tp_b > 1:
            nbytes *= hop_bytes_factor(self.cluster, tuple(range(a, a + tp_a)), tuple(range(b, b + tp_b)))
        return self.comm.p2p_time(a, b, nbytes)

    def assign(self, order: Sequence[int], pp: int, dp: int, strategy: str) -> Assignment:
        used = list(order[: pp * dp])
        if strategy == "replica-major":
            return tuple(tuple(used[r * pp + k] for k in range(pp)) for r in range(dp))
        return tuple(tuple(used[k * dp + r] for k in range(pp)) for r in range(dp))

    def signatures(self, st: Structure) -> Signatures:
        """Replicas grouped by the device types of their ranks (identical replicas share estimates)."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for r, row in enumerate(st.assignment):
            groups.setdefault(tuple(map(self.type_names.__getitem__, row)), []).append(r)
        return list(groups.items())

    def micro_batches(
        self, st: Structure, signatures: Signatures, weights: Sequence[float], total_mb: int
    ) -> tuple[int, ...]:
        """``total_mb`` micro-batches over the replicas in proportion to their signature's weight."""
        per_replica = [0.0] * st.dp
        for (_, members), w in zip(signatures, weights, strict=True):
            for r in members:
                per_replica[r] = w
        return distribute(total_mb, per_replica)

    def memory_ends(
        self,
        device_types: tuple[str, ...],
        mbs: int,
        dtype: str,
        option: MemoryOption,
        dp: int,
        flight: Flight,
        tp: int = 1,
    ) -> np.ndarray:
        """For each first layer i, the largest end j whose stage fits a device of every type in
        ``device_types`` by the memory prefix (:func:`~medley.search.estimate.bounds.memory_prefix`): per
        type ``bisect_right(prefix, prefix[i] + capacity) - 1``, the least over the types."""
        # Plain fields, not the dataclasses, so that hashing and comparing the key stays in C.
        key = (device_types, mbs, dtype, option.level, option.recompute, option.buckets, dp, flight.full,
               flight.after_b, tp)
        ends = self._memory_ends.get(key)
        if ends is None:
            if len(device_types) == 1:
                table = self.table(device_types[0], mbs, dtype, tp)
                prefix = memory_prefix(table, option=option, dp=dp, flight=flight)
                ends = np.searchsorted(prefix, prefix + self.type_capacity(device_types[0]), side="right") - 1
            else:
                ends = self.memory_ends(device_types[:1], mbs, dtype, option, dp, flight, tp)
                for t in device_types[1:]:  # elementwise minima, taken pairwise
                    ends = np.minimum(ends, self.memory_ends((t,), mbs, dtype, option, dp, flight, tp))
            self._memory_ends[key] = ends
        return ends

    def stage_time(
        self, device_type: str, split: Sequence[int], s: int, option: MemoryOption, mbs: int, tp: int = 1
    ) -> float:
        """F+B+W seconds of one micro-batch on stage ``s`` of ``split`` on ``device_type`` (one of
        ``tp`` TP ranks, all-reduces included)."""
        start = sum(split[:s])
        return self.table(device_type, mbs, tp=tp).time(start, start + split[s], recompute=option.recompute)
