"""Tied embeddings across a pipeline (Megatron-LM's scheme).

A model whose LM head shares the token embedding's weight keeps two copies of it when the head
and the embedding sit on different stages: the first stage's embedding and the last stage's
head copy (:class:`medley.runtime.transformer.Head`), initialised alike. After the step's gradient
reductions and before clipping and any optimizer step (the schedule's ``CLIP`` action), their
gradients are summed over a two-rank group per replica (the ranks of the first and of the last
stage), so both copies take the same update and stay bit-identical. When one rank holds both
stages (interleaved schedules), the sum is local.

The sum is taken on the gradients as OPTIM applies them: full all-reduced ones at ZeRO level
0, a rank's own rows at levels 1-3 (FSDP2 cuts dim 0 over the dp group, whose order is the
replica index, so both stages' shards of a replica hold the same rows). When either of the two
stages is sharded, each copy contributes the rows of its replica's shard (a full gradient its
slice of them) and a full gradient then gathers the summed rows over its stage's dp group.

Under tensor parallelism the embedding and the head are replicated on their stage's TP ranks
(their gradients agree there): TP rank 0 of each end takes part in the sum as above, then each
end's TP group broadcasts the result from its TP rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from medley.cost.zero_levels import tied_sum_by_rows
from medley.runtime.groups import RankGroups, RankTable
from medley.runtime.sharding import ShardedStage, shard_rows
from medley.runtime.tensor_parallel import local_tensor
from medley.runtime.torch_adapter import ordered_group
from medley.runtime.transformer import TIED_WEIGHT
from medley.schedule.ir import PipelineSchedule


@dataclass(kw_only=True)
class TiedGrads:
    """This rank's part in summing the tied weight's gradients.

    Attributes:
        params: this rank's copies of the tied weight with the stage holding each (one or two).
        group: the two-rank group of this replica's first- and last-stage ranks; None when one
            rank holds both stages (the sum is local).
        by_rows: whether the first or the last stage is sharded (ZeRO-1/2/3 with dp > 1): the sum
            then runs on the rows of this replica's shard.
        replica: this rank's replica (its index in the dp groups).
        dp: the number of replicas.
        tp_group: this rank's TP group when its degree is above 1 and the sum is not local (the
            result is broadcast there from TP rank 0); tp_rank: its place in it.
    """

    params: list[tuple[ShardedStage, torch.nn.Parameter]]
    group: dist.ProcessGroup | None
    by_rows: bool
    replica: int
    dp: int
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0

    def sum_grads(self) -> None:
        """Replace each copy's reduced gradient by the sum of both copies' gradients."""
        grads = [_local(stage, param) for stage, param in self.params]
        if self.tp_rank == 0 or self.group is None:  # a local sum: every TP rank does its own
            self._sum(grads)
        if self.tp_group is not None:
            for grad in grads:
                dist.broadcast(grad, group=self.tp_group, group_src=0)

    def _sum(self, grads: list[torch.Tensor]) -> None:
        pieces = [self._rows(stage, grad) if self.by_rows else grad
                  for (stage, _), grad in zip(self.params, grads, strict=True)]
        if self.group is None:
            total = pieces[0] + pieces[1]
            for piece in pieces:
                piece.copy_(total)
        else:
            dist.all_reduce(pieces[0], op=dist.ReduceOp.SUM, group=self.group)
        for (stage, param), grad in zip(self.params, grads, strict=True):
            group = stage.dp_group_of(param)
            if self.by_rows and not stage.sharded and group is not None:
                self._gather_rows(grad, group)

    def _rows(self, stage: ShardedStage, grad: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a gradient: a shard (ZeRO-1/2/3) is all of them, a full one a slice."""
        if stage.sharded:
            return grad
        start, count = shard_rows(grad.shape[0], self.dp, self.replica)
        return grad.narrow(0, start, count)

    def _gather_rows(self, grad: torch.Tensor, dp_group: dist.ProcessGroup) -> None:
        """Fill a full gradient with every replica's summed rows (padded pieces, gloo-safe)."""
        chunk = -(-grad.shape[0] // self.dp)
        mine = torch.zeros((chunk, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        start, count = shard_rows(grad.shape[0], self.dp, self.replica)
        own = grad.narrow(0, start, count)
        mine[:own.shape[0]] = own
        pieces = [torch.empty_like(mine) for _ in range(self.dp)]
        dist.all_gather(pieces, mine, group=dp_group)
        grad.copy_(torch.cat(pieces)[:grad.shape[0]])


def _local(stage: ShardedStage, param: torch.nn.Parameter) -> torch.Tensor:
    grad = stage.final_grad(param)
    if grad is None:
        raise RuntimeError(f"the tied weight {TIED_WEIGHT} has no gradient at the CLIP action")
    return local_tensor(grad)


def tied_ranks(table: RankTable, schedules: list[PipelineSchedule]) -> list[tuple[int, int]]:
    """Per replica, the global ranks of TP rank 0 of its first and of its last stage (the same
    rank possibly)."""
    pairs = []
    for replica, row in enumerate(table):
        stage_to_rank = schedules[replica].stage_to_rank
        pairs.append((row[stage_to_rank[0]][0], row[stage_to_rank[-1]][0]))
    return pairs


def build_tied_grads(groups: RankGroups, schedules: list[PipelineSchedule], stages: dict[int, ShardedStage],
                     zero: Sequence[int]) -> TiedGrads | None:
    """The tied-gradient sum of this rank (``zero``: the ZeRO level of each stage), or None when
    it holds neither end (collective: every rank creates every replica's group, in replica order)."""
    table, place = groups.table, groups.place
    pairs = tied_ranks(table, schedules)
    pair_groups = [ordered_group(pair) if pair[0] != pair[1] else None
                   for pair in pairs]
    last = schedules[place.replica].num_stages - 1
    params = [(stages[s], _tied_param(stages[s])) for s in (0, last) if s in stages]
    if not params:
        return None
    dp = len(table)
    by_rows = tied_sum_by_rows(zero, dp)
    group = pair_groups[place.replica]
    tp_group = groups.tp_group if group is not None else None
    return TiedGrads(params=params, group=group, by_rows=by_rows, replica=place.replica, dp=dp,
                     tp_group=tp_group, tp_rank=place.tp_rank)


def _tied_param(stage: ShardedStage) -> torch.nn.Parameter:
    return next(p for name, p in stage.named_parameters_local() if name == TIED_WEIGHT)
