"""The contracts between the cost model and its users (simulator, planner, profiler).

Everything downstream asks these questions and nothing else, so that a catalog estimate, a
measured profile or a Metis-format import can answer them interchangeably.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from medley.errors import MedleyInputError


class Pass(StrEnum):
    """The three compute passes of a layer (zero-bubble notation)."""

    F = "F"  # forward
    B = "B"  # input-gradient backward
    W = "W"  # weight-gradient backward


class Collective(StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


@dataclass(frozen=True, slots=True)
class TimeEstimate:
    """A duration and where it came from (``catalog``, ``profile:<file>``, ``metis:<file>``)."""

    seconds: float
    source: str


class ProfileRangeError(MedleyInputError):
    """A measured source has no measurement for this device type, micro-batch size or sequence
    length (and no fallback to ask): the planner skips the shapes that need it; any other error
    while it bounds, builds or simulates a candidate is a fault and surfaces."""


class CostSource(Protocol):
    """What the compiler asks a cost source: the time of a layer's pass (every source answers it)
    and what a measured source knows beyond it. Every source answers every question, the catalog
    estimate with None (:class:`MeasuresNothing`): the compiler then uses its formulas. There is
    one set of questions, so a source that forwards them (:mod:`medley.cost.user_profiles`) cannot
    drop one unseen."""

    def layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate:
        """Time of layer L, pass F/B/W, micro-batch b, sequence s, on device type D."""
        ...

    def activation_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> tuple[float, float] | None:
        """(bytes held from F until B, bytes still held from B until W) of one micro-batch."""
        ...

    def backward_full_time(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate | None:
        """Time of the fused backward (one autograd call) of one micro-batch."""
        ...

    def workspace_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        """Transient peak of one backward beyond the held activations (one layer at a time)."""
        ...

    def fsdp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        """Seconds a ZeRO-2/3 (FSDP-wrapped) stage adds to one pass of the layer."""
        ...

    def optimizer_time(self, params: float, *, device_type: str) -> TimeEstimate | None:
        """Time of one optimizer step over ``params`` parameters."""
        ...

    def tp_layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int
    ) -> TimeEstimate | None:
        """One of ``tp`` ranks' compute time of one pass of a block, measured with tensor
        parallelism (its all-reduces taken out: the compiler times those on the plan's group)."""
        ...

    def tp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        """Seconds the TP framework's dispatch adds to one pass of a block on a TP group."""
        ...

    def action_overhead_time(self, *, device_type: str) -> float | None:
        """Seconds the runtime's executor adds to every compute action on ``device_type``."""
        ...

    def p2p_overhead_time(self) -> float | None:
        """Seconds one point-to-point hand-off adds to a transfer beyond the link."""
        ...

    def collective_overhead_time(self) -> float | None:
        """Seconds the runtime adds to each ZeRO gather or reduction beyond the link."""
        ...


class MeasuresNothing:
    """The answers of a source that measured nothing beyond layer times (the catalog estimate, a
    Metis file for what it lacks): None to every optional question of :class:`CostSource`. A
    source derives from it and overrides what it knows."""

    def activation_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> tuple[float, float] | None:
        return None

    def backward_full_time(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate | None:
        return None

    def workspace_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        return None

    def fsdp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        return None

    def optimizer_time(self, params: float, *, device_type: str) -> TimeEstimate | None:
        return None

    def tp_layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int
    ) -> TimeEstimate | None:
        return None

    def tp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        return None

    def action_overhead_time(self, *, device_type: str) -> float | None:
        return None

    def p2p_overhead_time(self) -> float | None:
        return None

    def collective_overhead_time(self) -> float | None:
        return None


class CommModel(Protocol):
    """α-β communication times over the cluster's topology. Devices are global device ids."""

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float: ...

    def collective_time(self, op: Collective, devices: tuple[int, ...], nbytes: float) -> float:
        """Time of ``op`` over ``devices``; ``nbytes`` is the full (unsharded) buffer size."""
        ...

    def path_links(self, src: int, dst: int) -> tuple[str, ...]:
        """Names of the shared links a transfer from src to dst crosses (for contention)."""
        ...
