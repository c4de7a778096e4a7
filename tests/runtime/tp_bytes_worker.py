"""Rank body of the TP bytes test: the collectives one forward and one backward of a tp2 stage
of blocks issue, counted as torch's functional collectives (``torch.ops._c10d_functional``, what
``parallelize_module``'s DTensors call; the ``torch.distributed`` wrappers of the ZeRO bytes test
never see them) under a dispatch mode. Bytes are each collective's full (unsharded) buffer, as
:meth:`medley.cost.interfaces.CommModel.collective_time` takes them: an all-gather's output, a
reduce-scatter's and an all-reduce's input."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist
from equality_worker import MBS, SEED, SEQ, Case
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from medley.cost.interfaces import Collective
from medley.runtime.tensor_parallel import TP_DIM, apply_sequence_edges, parallelize_blocks
from medley.runtime.transformer import Decoder
from medley.spec.model_arg import get_model

FIRST_BLOCK = 1  # layer index of the first block (0 is the embedding)
OPS = {"all_reduce": Collective.ALL_REDUCE, "all_gather_into_tensor": Collective.ALL_GATHER,
       "reduce_scatter_tensor": Collective.REDUCE_SCATTER}


class CountCollectives(TorchDispatchMode):
    """Calls and full-buffer bytes of every functional collective issued while active, by
    :class:`Collective` (``other``: the names of any collective not among them)."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group
        self.calls = dict.fromkeys(Collective, 0)
        self.nbytes = dict.fromkeys(Collective, 0)
        self.other: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        functional = name.startswith("_c10d_functional.")
        op = name.removeprefix("_c10d_functional.").split(".")[0] if functional else None
        if op in OPS:
            size = args[0].numel() * args[0].element_size()
            self.calls[OPS[op]] += 1
            self.nbytes[OPS[op]] += size * (self.group if op == "all_gather_into_tensor" else 1)
        elif op is not None and op != "wait_tensor":
            self.other.add(name)
        return func(*args, **(kwargs or {}))


def count_tp_bytes(case: Case, *, sharded_edges: bool = False) -> dict[str, Any]:
    """Build ``case.split[0]`` blocks of tiny, shard them over all ranks (one TP group; sequence
    parallel as ``case`` says: the stage's input and output whole, or with ``sharded_edges`` this
    rank's sequence shards), run one forward and one backward of a micro-batch, and report each
    pass's calls and bytes per collective."""
    spec = get_model("tiny")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(TP_DIM,))
    stage = Decoder(spec, first_layer=FIRST_BLOCK, last_layer=FIRST_BLOCK + case.split[0], seed=SEED)
    parallelize_blocks(stage, mesh, sequence_parallel=case.sequence_parallel)
    if case.sequence_parallel:
        apply_sequence_edges(stage, mesh, sharded_input=sharded_edges, sharded_output=sharded_edges)
    seq = SEQ // world if sharded_edges else SEQ
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(MBS, seq, spec.hidden_size, generator=gen, requires_grad=True)
    grad = torch.randn(MBS, seq, spec.hidden_size, generator=gen)
    out: dict[str, Any] = {}
    forward = CountCollectives(world)
    with forward:
        y = stage(x)
    backward = CountCollectives(world)
    with backward:
        y.backward(grad)
    for kind, mode in (("F", forward), ("B", backward)):
        for op in Collective:
            out[f"{kind}.{op.value}.calls"] = float(mode.calls[op])
            out[f"{kind}.{op.value}.bytes"] = float(mode.nbytes[op])
        out[f"{kind}.other"] = ",".join(sorted(mode.other))
    return out


def count_tp_bytes_sharded(case: Case) -> dict[str, Any]:
    """:func:`count_tp_bytes` with the stage's edges sequence-sharded."""
    return count_tp_bytes(case, sharded_edges=True)


def count_saved_bytes(case: Case) -> dict[str, Any]:
    """Bytes of the distinct storages one block of tiny (``WIDE_HEADS`` of the census test: q_dim
    unlike hidden) saves for backward on this TP rank, parameters left out, with and without
    sequence parallelism (its input and output then this rank's sequence shards)."""
    from test_tp_activation_census import WIDE_HEADS

    spec = WIDE_HEADS
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(TP_DIM,))
    out: dict[str, Any] = {}
    for sequence_parallel in (False, True):
        stage = Decoder(spec, first_layer=FIRST_BLOCK, last_layer=FIRST_BLOCK + 1, seed=SEED)
        parallelize_blocks(stage, mesh, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            apply_sequence_edges(stage, mesh, sharded_input=True, sharded_output=True)
        params = {_local(p).untyped_storage().data_ptr() for p in stage.parameters()}
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor, params: set[int] = params,
                 seen: dict[int, int] = seen) -> torch.Tensor:
            storage = _local(tensor).untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        seq = case.split[0] // world if sequence_parallel else case.split[0]
        x = torch.randn(MBS, seq, spec.hidden_size, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            stage(x)
        out["sp" if sequence_parallel else "tp"] = float(sum(seen.values()))
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


RECOMPUTE_MODES = ("none", "full", "selective", "full:1", "selective:1")


def _settled(tracker: Any) -> int:  # a LiveTensorBytes (imported where it is used)
    """The tracked bytes once nothing but the forward's own references holds them: garbage in
    reference cycles collected, and gloo's worker thread given time to drop the buffers of the
    collectives it ran (it holds each work a moment after the wait returns; an all-gathered
    activation was counted in about one run in three without this)."""
    previous = -1
    for _ in range(20):
        gc.collect()
        live = tracker.live()
        if live == previous:
            return live
        previous = live
        time.sleep(0.02)
    return previous


def count_sp_recompute_bytes(case: Case) -> dict[str, Any]:
    """What one micro-batch's forward leaves alive on this TP rank of each stage of tiny split
    ``case.split`` (tp = all ranks, sequence parallelism; the edge between the stages sharded, as
    :func:`medley.plan.layout.sharded_edges` says), per recomputation mode: the live local storages
    with the stage's input and without its output, as ``test_recompute_memory`` counts them at tp 1
    and at its shape (that of the tiny profile)."""
    from test_recompute_memory import MBS, SEQ

    from medley.cost.recompute import parse_recompute
    from medley.plan.layout import sharded_edges
    from medley.runtime.memory import LiveTensorBytes
    from medley.runtime.transformer import token_loss_sum

    spec = get_model("tiny")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(TP_DIM,))
    ranges, first = [], 0
    for count in case.split:
        ranges.append(range(first, first + count))
        first += count
    edges = sharded_edges(spec, ranges, [world] * len(ranges))
    out: dict[str, Any] = {}
    for mode in RECOMPUTE_MODES:
        for s, layers in enumerate(ranges):
            stage = Decoder(spec, first_layer=layers.start, last_layer=layers.stop, seed=SEED,
                            recompute=parse_recompute(mode))
            parallelize_blocks(stage, mesh, sequence_parallel=True)
            apply_sequence_edges(stage, mesh, sharded_input=s - 1 in edges, sharded_output=s in edges)
            gen = torch.Generator().manual_seed(SEED + 1)
            if layers.start == 0:
                x = torch.randint(0, spec.vocab_size, (MBS, SEQ), generator=gen)
            else:
                seq = SEQ // world if s - 1 in edges else SEQ
                x = torch.randn(MBS, seq, spec.hidden_size, generator=gen, requires_grad=True)
            targets = torch.randint(0, spec.vocab_size, (MBS, SEQ), generator=gen)
            tracker = LiveTensorBytes([*map(_local, stage.parameters()), x])
            base = tracker.live()
            last = layers.stop == spec.num_layers
            with tracker:
                y = stage(x)
                if last:
                    y = token_loss_sum(y, targets)
                held = _settled(tracker) - base
            kept = held + x.untyped_storage().nbytes() - (0 if last else _local(y).untyped_storage().nbytes())
            out[f"{mode}/{s}"] = float(kept)
    return out
