"""``medley profile --comm`` under torchrun: point-to-point and collectives per network tier.

Every rank names its node (``MEDLEY_NODE``, else the host name, as the launcher's ranks do). Then,
over the backend of the machine (NCCL on GPUs, gloo on CPU): inside each node with two or more
ranks (tier ``intra-node``), and across the first rank of every node (tier ``inter-node``), the
same operations and sizes as :mod:`medley.profile.comm_bench` (a send/recv ping-pong between the
group's first two ranks, all-gather, reduce-scatter, all-reduce), each timed as the slowest rank's
median after a barrier, and fitted to the α-β ring model. Rank 0 returns the
:class:`~medley.cost.comm_profile.CommTierProfile`; the others return None.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from medley.cost.comm_profile import COMM_PROFILE_FORMAT, COMM_PROFILE_VERSION, CommTierProfile, TierLink
from medley.cost.profile_format import CommMeasurement
from medley.errors import MedleyInputError
from medley.profile.comm_bench import DEFAULT_SIZES, fit_alpha_beta, measure_group
from medley.runtime.placement import NODE_ENV


def _tier_groups(names: Sequence[str]) -> list[tuple[str, list[str], list[int]]]:
    """(tier, nodes, global ranks) of every group to measure."""
    by_node: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        by_node.setdefault(name, []).append(rank)
    groups = [("intra-node", [n], ranks) for n, ranks in by_node.items() if len(ranks) >= 2]
    if len(by_node) >= 2:
        groups.append(("inter-node", list(by_node), [ranks[0] for ranks in by_node.values()]))
    return groups


def measure_tiers(
    *, sizes: Sequence[int] = DEFAULT_SIZES, runs: int = 5, warmup: int = 2
) -> CommTierProfile | None:
    """Measure every tier this torchrun job spans (module docstring)."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise MedleyInputError("--comm: run it under torchrun with two or more ranks (e.g. torchrun "
                               "--nproc-per-node 2 medley profile --comm ...); set MEDLEY_NODE per node.")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        names: list[str] = [""] * world
        dist.all_gather_object(names, os.environ.get(NODE_ENV) or socket.gethostname())
        links = []
        for tier, nodes, ranks in _tier_groups(names):
            group = dist.new_group(ranks)
            rows = (measure_group(rank, ranks, group=group, sizes=sizes, runs=runs, warmup=warmup,
                                  device=device) if rank in ranks else [])
            gathered: list[list[dict]] = [[] for _ in range(world)]
            dist.all_gather_object(gathered, rows)
            measured = [CommMeasurement(**row) for row in gathered[ranks[0]]]
            links.append(TierLink(tier=tier, nodes=nodes, ranks=len(ranks), fit=fit_alpha_beta(measured),
                                  measurements=measured))
        counts = {n: names.count(n) for n in dict.fromkeys(names)}
        return CommTierProfile(
            format=COMM_PROFILE_FORMAT, version=COMM_PROFILE_VERSION,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            backend=dist.get_backend(), world_size=world, ranks_per_node=counts, links=links,
        ) if rank == 0 else None
    finally:
        dist.destroy_process_group()
