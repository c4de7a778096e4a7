"""Where a rank's pipeline transfers go and in what form: the TP group at each end of a hop, which
of its members send to which (:func:`medley.plan.layout.tp_sources`), and whether a hop carries
whole tensors, a TP rank's slice of one (:func:`medley.plan.layout.tp_scattered`) or a sequence
shard (:func:`medley.plan.layout.sequence_sharded_edges`). Pure: the executor asks, torch sends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from medley.plan.layout import tp_scattered, tp_sources


@dataclass(frozen=True, kw_only=True)
class Hops:
    """The hops of one rank of a replica.

    Attributes:
        pipeline: the global ranks of each pipeline rank of the replica, in TP rank order.
        stage_to_rank: the pipeline rank of each stage (the schedule's).
        rank: this rank's pipeline rank; tp_rank: its place in its TP group.
        local_stages: the stages this rank runs (a hop between two of them stays in memory).
        sequence_edges: stages whose output crosses to the next as each TP rank's sequence shard.
        activation_shape: [micro_batch_size, seq, hidden] of a whole transferred tensor.
    """

    pipeline: tuple[tuple[int, ...], ...]
    stage_to_rank: Sequence[int]
    rank: int
    tp_rank: int
    local_stages: frozenset[int]
    sequence_edges: frozenset[int]
    activation_shape: tuple[int, ...]

    @property
    def tp(self) -> int:
        """This rank's TP degree."""
        return len(self.pipeline[self.rank])

    def group(self, stage: int) -> tuple[int, ...]:
        """Global ranks of the TP group holding ``stage`` in this replica."""
        return self.pipeline[self.stage_to_rank[stage]]

    def destinations(self, peer_stage: int) -> list[int]:
        """The ranks of ``peer_stage`` this rank sends to: those whose source it is."""
        theirs = self.group(peer_stage)
        sources = tp_sources(senders=self.tp, receivers=len(theirs))
        return [rank for rank, source in zip(theirs, sources, strict=True) if source == self.tp_rank]

    def source(self, peer_stage: int) -> int:
        """The rank of ``peer_stage`` this rank receives from."""
        theirs = self.group(peer_stage)
        return theirs[tp_sources(senders=len(theirs), receivers=self.tp)[self.tp_rank]]

    def sequence_sharded(self, peer_stage: int, stage: int) -> bool:
        """Whether tensors between ``stage`` (this rank's) and ``peer_stage`` are sequence shards."""
        return min(peer_stage, stage) in self.sequence_edges

    def scattered(self, peer_stage: int, stage: int) -> bool:
        """Whether transfers between ``stage`` and ``peer_stage`` carry slices of a whole tensor
        (:func:`tp_scattered`); a stage on this rank hands its tensors over in memory, and a
        sequence shard crosses as it is."""
        if peer_stage in self.local_stages or self.sequence_sharded(peer_stage, stage):
            return False
        return tp_scattered(senders=len(self.group(peer_stage)), receivers=self.tp)

    def slice_numel(self) -> int:
        """Elements of one TP rank's slice of a scattered tensor (the degree divides the hidden
        size: :func:`medley.plan.layout.tp_undivided`)."""
        return prod(self.activation_shape) // self.tp

    def received_shape(self, peer_stage: int, stage: int) -> tuple[int, ...]:
        """The shape of what ``stage`` receives from ``peer_stage``: a slice (flat), a sequence
        shard or the whole tensor."""
        if self.scattered(peer_stage, stage):
            return (self.slice_numel(),)
        if self.sequence_sharded(peer_stage, stage):
            batch, seq, hidden = self.activation_shape
            return (batch, seq // self.tp, hidden)
        return self.activation_shape
