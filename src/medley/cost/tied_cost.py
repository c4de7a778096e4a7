"""Time of the tied embeddings' gradient sum (:mod:`medley.runtime.tied`) for the simulator."""

from __future__ import annotations

from collections.abc import Sequence

from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import Collective
from medley.cost.zero_levels import tied_sum_by_rows, zero_level
from medley.spec.model import ModelSpec


def tied_sum_seconds(comm: TopologyCommModel, *, model: ModelSpec, assignment: Sequence[Sequence[int]],
                     stage_to_rank: Sequence[int], zero: Sequence[int], grad_bytes: float) -> float:
    """Seconds the step's ``CLIP`` waits for the tied gradients' sum (the slowest replica's):
    per replica an all-reduce of the tied weight's gradient (a shard's rows when the first or the
    last stage is ZeRO-1/2/3) between the devices of the first and the last stage (none when one
    device holds both), then, when one end is sharded, the other's all-gather of the summed
    rows over its dp group. ``zero``: the ZeRO level of each stage; ``grad_bytes`` per element."""
    if not model.tied_embeddings or len(zero) < 2:
        return 0.0
    dp = len(assignment)
    full = model.vocab_size * model.embed_dim * grad_bytes
    by_rows = tied_sum_by_rows(zero, dp)
    first, last = stage_to_rank[0], stage_to_rank[-1]
    pairs = [(row[first], row[last]) for row in assignment]
    worst = max(comm.collective_time(Collective.ALL_REDUCE, pair, full / dp if by_rows else full)
                if pair[0] != pair[1] else 0.0 for pair in pairs)
    gather = 0.0
    if by_rows:
        for rank, level in ((first, zero[0]), (last, zero[-1])):
            if not zero_level(level).shards_optimizer:
                group = tuple(row[rank] for row in assignment)
                gather += comm.collective_time(Collective.ALL_GATHER, group, full)
    return worst + gather
