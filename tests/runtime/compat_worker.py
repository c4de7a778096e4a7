"""Rank body of the torch-compatibility test: each function of :mod:`medley.runtime.torch_adapter`
that has a fallback, run once with torch's own API and once with the fallback
(``MEDLEY_TORCH_FALLBACKS=1``), on gloo; the figures of both go back to the test."""

from __future__ import annotations

import datetime
import json
import os
import traceback

import torch
import torch.distributed as dist
from equality_worker import Case, run_case
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from medley.runtime.torch_adapter import (
    FALLBACKS_ENV,
    all_gather_single,
    fsdp_reduce_grad,
    ordered_group,
    reduce_scatter_single,
    reduce_scatter_unused_params,
)

WORLD = 3
ORDER = [2, 0, 1]  # neither sorted nor reversed: group rank i is global rank ORDER[i]
WIDTH = 6  # rows of each weight, a multiple of WORLD so FSDP2's shards are even


class TwoLayers(nn.Module):
    """The second layer runs on some ranks only, as a padded round of a replica with fewer
    micro-batches runs no layer at all."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        y = self.first(x)
        return self.second(y) if use_second else y


def uses_second(rank: int) -> bool:
    return rank != 1


def rank_input(rank: int) -> torch.Tensor:
    return torch.arange(2 * WIDTH, dtype=torch.float32).view(2, WIDTH) / (rank + 1)


def fresh_model() -> TwoLayers:
    torch.manual_seed(0)
    return TwoLayers()


def _groups(rank: int) -> dict:
    group = ordered_group(ORDER)
    pieces = [torch.zeros(1) for _ in ORDER]
    dist.all_gather(pieces, torch.tensor([float(rank)]), group=group)
    mesh = DeviceMesh.from_group(group, "cpu", mesh=torch.tensor(ORDER))
    whole = DTensor.from_local(torch.tensor([float(rank)]), mesh, [Shard(0)]).full_tensor()
    return {"group_rank": group.rank(), "group_ranks": dist.get_process_group_ranks(group),
            "all_gather": [p.item() for p in pieces], "mesh_coordinate": mesh.get_coordinate(),
            "dtensor_full": whole.tolist()}


def _collectives(rank: int) -> dict:
    group = ordered_group(ORDER)
    shard = torch.tensor([10.0 * rank, 10.0 * rank + 1])
    gathered = torch.zeros(2 * WORLD)
    all_gather_single(gathered, shard, group=group)
    full = torch.arange(2.0 * WORLD) + rank
    reduced = torch.zeros(2)
    reduce_scatter_single(reduced, full, group=group)
    return {"all_gather_single": gathered.tolist(), "reduce_scatter_single": reduced.tolist()}


def _unused_params(rank: int) -> dict:
    model = fresh_model()
    unit = fully_shard(model, mesh=DeviceMesh.from_group(ordered_group(range(WORLD)), "cpu"),
                       reshard_after_forward=False)
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)
    reduce_scatter_unused_params(unit)
    unit.set_requires_gradient_sync(False)
    model(rank_input(rank), uses_second(rank)).square().sum().backward()
    fsdp_reduce_grad(unit)
    return {name: p.grad.to_local().tolist() for name, p in model.named_parameters()}


def figures(rank: int) -> dict:
    """Every figure of this rank, under torch's API and under the fallbacks."""
    out = {}
    for mode in ("native", "fallback"):
        os.environ[FALLBACKS_ENV] = "1" if mode == "fallback" else "0"
        out[mode] = {"groups": _groups(rank), "collectives": _collectives(rank),
                     "unused_params": _unused_params(rank)}
    os.environ.pop(FALLBACKS_ENV)
    return out


def worker(rank: int, world: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = figures(rank)
    except Exception:  # noqa: BLE001 - reported to the test; the other ranks then time out
        result = {"error": traceback.format_exc(limit=8)}
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def run_case_with_fallbacks(case: Case) -> dict:
    """The equality check of ``case`` (:func:`equality_worker.run_case`) with every fallback taken."""
    os.environ[FALLBACKS_ENV] = "1"
    try:
        return run_case(case)
    finally:
        os.environ.pop(FALLBACKS_ENV)
