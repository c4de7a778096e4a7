"""Rank body of the ZeRO bytes test: the bytes each collective kind moves in one training step,
counted by wrapping the ``torch.distributed`` calls that medley and FSDP2 make."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from equality_worker import LR, MBS, SEED, SEQ, Case, global_batch, replica_batch

from medley.plan.world import build_world
from medley.runtime.executor import RankExecutor
from medley.runtime.groups import make_groups, segment_holders
from medley.runtime.sharding import TORCH_DTYPES
from medley.runtime.stages import build_local_stages
from medley.runtime.transformer import token_loss_sum
from medley.schedule.ir import with_default_collectives
from medley.spec.model_arg import get_model

# torch.distributed call -> (collective kind as the simulator names it, position and name of the
# argument whose size counts: the full buffer, i.e. an all-gather's output, a reduce-scatter's input).
COUNTED: dict[str, tuple[str, int, str]] = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "all_gather": ("all_gather_list", 0, "tensor_list"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce_scatter": ("reduce_scatter_list", 1, "input_list"),
}

# Pipeline transfers and the all-gathers of scattered hops (test_scattered_hops): the tensors of the
# sends of each batch the executor posts.
HOP_CALLS: dict[str, tuple[str, int, str]] = {
    "batch_isend_irecv": ("send", 0, "p2p_op_list"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),  # its name before torch 2.13
}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dist.P2POp):  # a send of a batch counts, a receive does not
        return _nbytes(value.tensor) if value.op is dist.isend else 0
    return sum(_nbytes(v) for v in value)  # a list of tensors


@contextlib.contextmanager
def counting(totals: dict[str, int], calls: dict[str, tuple[str, int, str]] = COUNTED) -> Iterator[None]:
    """Add the bytes of every call of ``calls`` issued inside the block to ``totals`` by kind
    (group size 1 excluded: nothing moves). A name this torch lacks (the ``*_single`` calls before
    2.13) is not wrapped: medley then issues the older name (:mod:`medley.runtime.torch_adapter`)."""
    originals = {name: getattr(dist, name) for name in calls if hasattr(dist, name)}

    def wrap(name: str, call: Callable) -> Callable:
        kind, position, keyword = calls[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            if dist.get_world_size(kwargs.get("group")) > 1:
                value = kwargs[keyword] if keyword in kwargs else args[position]
                totals[kind] = totals.get(kind, 0) + _nbytes(value)
            return call(*args, **kwargs)
        return counted

    for name, call in originals.items():
        setattr(dist, name, wrap(name, call))
    try:
        yield
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)


def count_hops(case: Case) -> dict:
    """:func:`count_case` of the pipeline sends and the all-gathers (:data:`HOP_CALLS`)."""
    return count_case(case, calls=HOP_CALLS)


def count_case(case: Case, calls: dict[str, tuple[str, int, str]] = COUNTED) -> dict:
    """Bytes per collective kind of this rank's second step (the first one warms up), keyed
    ``rank<global rank>.<kind>`` so the launcher's per-figure max keeps every rank's."""
    spec = get_model("tiny")
    split, zero, units, holders = case.split, case.zero, None, None
    if case.groups:  # replica groups of their own shape: each replica's own split, ZeRO and units
        world = build_world(case.groups)
        holders = segment_holders(world.segments)
    groups = make_groups(case.table, holders)
    place = groups.place
    if case.groups:
        group, _ = world.segments.where(place.replica)
        layout = world.groups[group]
        split, zero = layout.stage_layers, tuple(z.level for z in layout.zero)
        units = world.segments.units[group]
    micro_batches = [s.num_micro_batches for s in case.schedules]
    schedule = with_default_collectives(case.schedules[place.replica])
    stages = build_local_stages(spec, schedule=schedule, split=split, zero=zero, groups=groups,
                                seed=SEED, optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(lr=LR),
                                precision=case.dtype, units=units)
    half = None if case.dtype == "fp32" else TORCH_DTYPES[case.dtype]
    executor = RankExecutor(
        schedule=schedule, pipeline_rank=place.pipeline_rank, stages=stages, pipeline=groups.pipeline,
        tp_rank=place.tp_rank, tp_group=groups.tp_group,
        activation_shape=(MBS, SEQ, spec.hidden_size), dtype=TORCH_DTYPES[case.dtype], autocast_dtype=half,
        loss_fn=token_loss_sum)
    totals: dict[str, int] = {}
    for step in range(2):
        batch = replica_batch(global_batch(micro_batches, step), micro_batches, place.replica)
        with counting(totals, calls) if step == 1 else contextlib.nullcontext():
            executor.run_step(batch)
    rank = dist.get_rank()
    return {f"rank{rank}.{kind}": float(value) for kind, value in totals.items()} | {f"rank{rank}.steps": 1.0}
