"""Which plan device each rank is, and so which rank runs each (replica, pipeline rank) of a plan.

A rank's node is ``MEDLEY_NODE`` (``medley launch`` sets it per node); without it, when the ranks
on this machine are the whole world (``medley train --local-ranks N``, ``torchrun --standalone``),
this machine plays every node; else it is the cluster node whose ``host`` is this machine's host
name. (With every rank here, playing every node gives what a host match would, or where the
plan spans other nodes too, the only table that can work.) On
a node, LOCAL_RANK i is the i-th of the node's plan devices in ascending device id (the
launcher's ``CUDA_VISIBLE_DEVICES`` lists exactly those, in that order); a machine playing every
node takes the i-th plan device of the whole cluster. An elastic run names each rank's device
(``MEDLEY_DEVICE``): its re-planned plan may leave some of a node's ranks out.

At start-up every rank says who it is (:class:`RankIdentity`, one ``all_gather_object`` before any
model is built) and :func:`rank_table` turns the identities into ``table[replica][pipeline rank]``
= the global ranks on the devices of ``layout.group(r, p)`` (TP rank order), so the TP group
starting at ``assignment[r][p]`` runs stage(s) of pipeline rank ``p`` of replica ``r`` whatever
order the launcher gave the ranks. A planned device without a rank, a rank without a plan
device, two ranks on one device or a GPU that is not the planned type is one error naming the
node, the local rank, what was planned and what was found; every rank raises the same one.

The pure part (identities to table) imports no torch: tests inject identities.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from medley.errors import MedleyInputError
from medley.plan.layout import PlanLayout
from medley.plan.plan import Plan
from medley.spec.catalog import cuda_mismatch
from medley.spec.cluster import Cluster
from medley.spec.cluster_schema import printable

NODE_ENV = "MEDLEY_NODE"
# The plan device a rank is, when its launcher decided it (elastic runs: a re-planned plan may
# leave some of a node's started ranks out, so LOCAL_RANK no longer counts the plan's devices).
DEVICE_ENV = "MEDLEY_DEVICE"


@dataclass(frozen=True, kw_only=True)
class RankIdentity:
    """What one rank says about itself at start-up.

    Attributes:
        rank: global rank.
        node: the cluster node it is on; None: this machine plays every node.
        local_rank: LOCAL_RANK (its index among the plan devices of its node).
        local_world: ranks started on its machine (LOCAL_WORLD_SIZE).
        gpu_name: ``torch.cuda.get_device_name()`` of its GPU; None when it computes on a CPU.
        gpu_memory_bytes: its GPU's total memory (0 on a CPU).
        device: the plan device its launcher gave it (``MEDLEY_DEVICE``); None: its node's
            LOCAL_RANK-th plan device.
        error: why it could not tell its node (reported by every rank alike); None if it could.
    """

    rank: int
    node: str | None
    local_rank: int
    local_world: int
    gpu_name: str | None = None
    gpu_memory_bytes: int = 0
    device: int | None = None
    error: str | None = None

    @property
    def where(self) -> str:
        """``rank R (node N, local rank L)`` for error messages."""
        node = f"node '{self.node}'" if self.node is not None else "this machine, playing every node"
        return f"rank {self.rank} ({node}, local rank {self.local_rank})"


@dataclass(frozen=True, kw_only=True)
class PlacementEntry:
    """Where one rank runs, as it measured it (``medley train --json``'s ``placement``).

    Attributes:
        rank: global rank.
        node: the cluster node of its device.
        device: its plan device id.
        replica: the replica it computes for; pipeline_rank: its position in that replica.
        stages: the global stages it built.
        tp_rank: its place in its pipeline rank's TP group.
    """

    rank: int
    node: str
    device: int
    replica: int
    pipeline_rank: int
    stages: tuple[int, ...]
    tp_rank: int = 0

    def as_json(self) -> dict[str, object]:
        return {**asdict(self), "stages": list(self.stages)}


def world_size_terms(plan: Plan) -> str:
    """How the plan's rank count comes about, for messages: ``pp P x dp D`` without TP, else
    ``dp D x (tp t0 + t1 + ...)``, the sum of the pipeline ranks' TP degrees."""
    terms = [_group_terms(layout) for layout in plan.groups]
    return terms[0] if len(terms) == 1 else " + ".join(f"({term})" for term in terms)


def ranks_needed(plan: Plan) -> str:
    """``pp P x dp D = N ranks`` (``= 1 rank`` for one), for messages."""
    count = plan.world_size
    return f"{world_size_terms(plan)} = {count} rank{'' if count == 1 else 's'}"


def _group_terms(layout: PlanLayout) -> str:
    if set(layout.tp) <= {1}:
        return f"pp {layout.pp} x dp {layout.dp}"
    return f"dp {layout.dp} x (tp {' + '.join(str(layout.tp_of(k)) for k in range(layout.pp))})"


def plan_devices(plan: Plan) -> list[int]:
    """The device ids the plan uses (every device of every TP group), ascending."""
    return sorted(plan.devices)


def plan_devices_by_node(plan: Plan) -> dict[str, list[int]]:
    """Each node's plan devices, ascending (LOCAL_RANK i is the i-th), nodes in cluster order."""
    used = set(plan_devices(plan))
    by_node = {node.name: sorted(d for d in node.device_ids if d in used) for node in plan.cluster.nodes}
    return {name: devices for name, devices in by_node.items() if devices}


def find_node(cluster: Cluster, *, env: Mapping[str, str], hostname: str, local_world: int,
              world: int) -> str | None:
    """This machine's cluster node (see the module doc); None: it plays every node."""
    names = [node.name for node in cluster.nodes]
    given = env.get(NODE_ENV)
    if given is not None:
        if given not in names:
            raise MedleyInputError(
                f"{NODE_ENV}='{printable(given)}' is not a node of cluster '{cluster.name}' (nodes: "
                f"{', '.join(names[:8])}); set {NODE_ENV} to one of them (medley launch does)")
        return given
    if local_world == world:  # every rank is here; a host match would say the same (or be wrong)
        return None
    short = hostname.split(".")[0].lower()
    matches = [node.name for node in cluster.nodes
               if node.host is not None and node.host.lower() in (hostname.lower(), short)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise MedleyInputError(
            f"host '{printable(hostname)}' is the host of nodes {', '.join(matches[:4])} of the cluster "
            f"file; set {NODE_ENV}=<node> to say which one this machine is")
    raise MedleyInputError(
        f"cannot tell which node of cluster '{cluster.name}' this machine (host '{printable(hostname)}') "
        f"is: {world - local_world} of the {world} ranks run elsewhere and no node has this host; set "
        f"{NODE_ENV}=<node> (medley launch does) or add host = \"{printable(short)}\" to its [[nodes]] entry")


def _device_of(plan: Plan, identity: RankIdentity, by_node: Mapping[str, list[int]]) -> int:
    devices = plan_devices(plan) if identity.node is None else by_node.get(identity.node, [])
    if identity.device is not None:
        if identity.device in devices:
            return identity.device
        raise MedleyInputError(
            f"{identity.where} was given plan device {identity.device} ({DEVICE_ENV}), which the plan does "
            f"not use there (ids {', '.join(map(str, devices[:16])) or 'none'}); unset {DEVICE_ENV}")
    if identity.local_rank < len(devices):
        return devices[identity.local_rank]
    where = "the whole cluster" if identity.node is None else f"node '{identity.node}'"
    raise MedleyInputError(
        f"{identity.where} has no plan device: the plan uses {len(devices)} device(s) on {where} "
        f"(ids {', '.join(map(str, devices[:16])) or 'none'}) but {identity.local_world} rank(s) started "
        f"there; start {len(devices)} (torchrun --nproc-per-node {len(devices)}, or medley launch)")


def planned_device(plan: Plan, identity: RankIdentity) -> int | None:
    """The plan device ``identity`` is; None when it is none (:func:`rank_table` says why)."""
    if identity.error is not None:
        return None
    try:
        return _device_of(plan, identity, plan_devices_by_node(plan))
    except MedleyInputError:
        return None


def _position(plan: Plan) -> dict[int, tuple[int, int]]:
    """(global replica, pipeline rank) of each plan device (each device of its TP group)."""
    return {device: (r, p) for r, (layout, local) in enumerate(plan.replicas) for p in range(layout.pp)
            for device in layout.group(local, p)}


def _check_gpu(plan: Plan, identity: RankIdentity, device: int) -> None:
    if identity.gpu_name is None:
        return
    planned = plan.cluster.devices[device].type
    why = cuda_mismatch(planned, identity.gpu_name, identity.gpu_memory_bytes)
    if why is not None:
        replica, rank = _position(plan)[device]
        raise MedleyInputError(
            f"{identity.where}: the plan puts device {device} ({planned.name}, pipeline rank {rank} of "
            f"replica {replica}) here but cuda:{identity.local_rank} is '{printable(identity.gpu_name)}' "
            f"with {identity.gpu_memory_bytes / 1e9:.1f} GB: {why}; start the ranks on the planned GPUs or "
            "re-plan for the cluster this machine is in")


def _missing(plan: Plan, device: int, identities: Sequence[RankIdentity],
             by_node: Mapping[str, list[int]]) -> MedleyInputError:
    replica, rank = _position(plan)[device]
    node = plan.cluster.devices[device].node
    plays_all = all(i.node is None for i in identities)
    devices = plan_devices(plan) if plays_all else by_node[node]
    started = sum(1 for i in identities if plays_all or i.node == node)
    where = "this machine, which plays every node" if plays_all else f"node '{node}'"
    return MedleyInputError(
        f"plan device {device} ({plan.cluster.devices[device].type.name} on node '{node}', local rank "
        f"{devices.index(device)}: pipeline rank {rank} of replica {replica}) has no rank: {started} "
        f"rank(s) started on {where}; start {len(devices)} there (torchrun --nproc-per-node {len(devices)}, "
        "or medley launch)")


def rank_table(plan: Plan, identities: Sequence[RankIdentity]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``table[replica][pipeline rank]``: the global ranks on the plan's devices for that position
    (those of ``layout.group(replica, pipeline rank)`` of the replica's group, in TP rank order;
    global replicas, groups in order)."""
    for identity in sorted(identities, key=lambda i: i.rank):
        if identity.error is not None:
            raise MedleyInputError(f"rank {identity.rank}: {identity.error}")
    by_node = plan_devices_by_node(plan)
    owner: dict[int, RankIdentity] = {}
    for identity in sorted(identities, key=lambda i: i.rank):
        device = _device_of(plan, identity, by_node)
        if device in owner:
            raise MedleyInputError(
                f"{identity.where} and {owner[device].where} are both plan device {device}: two agents "
                f"run for one node; give each node its own {NODE_ENV} (medley launch does)")
        _check_gpu(plan, identity, device)
        owner[device] = identity
    for device in plan_devices(plan):
        if device not in owner:
            raise _missing(plan, device, identities, by_node)
    return tuple(tuple(tuple(owner[d].rank for d in layout.group(local, p)) for p in range(layout.pp))
                 for layout, local in plan.replicas)


def device_table(plan: Plan, identities: Sequence[RankIdentity]) -> list[int]:
    """The plan device of every global rank (after :func:`rank_table` accepted the identities)."""
    by_node = plan_devices_by_node(plan)
    return [_device_of(plan, i, by_node) for i in sorted(identities, key=lambda i: i.rank)]


def started_identities(plan: Plan) -> list[RankIdentity]:
    """The ranks ``medley launch`` starts for ``plan`` when its node agents join in cluster order:
    node by node, each node's LOCAL_RANK i on its i-th plan device (ascending id), global ranks
    counting on. The numbering a dry run (``medley check --ranks``) builds by."""
    out: list[RankIdentity] = []
    for node, devices in plan_devices_by_node(plan).items():
        start = len(out)
        out += [RankIdentity(rank=start + i, node=node, local_rank=i, local_world=len(devices))
                for i in range(len(devices))]
    return out


def my_identity(cluster: Cluster, *, rank: int, world: int, on_cuda: bool) -> RankIdentity:
    """This process's identity from the launcher's environment (and its GPU under nccl); without
    LOCAL_RANK (ranks started by hand) every rank is on this machine."""
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    given = os.environ.get(DEVICE_ENV)
    device = int(given) if given is not None and given.isdigit() else None
    try:
        node = find_node(cluster, env=os.environ, hostname=socket.gethostname(), local_world=local_world,
                         world=world)
    except MedleyInputError as err:
        return RankIdentity(rank=rank, node=None, local_rank=local_rank, local_world=local_world,
                            error=str(err))
    name, memory = None, 0
    if on_cuda:
        import torch

        name = torch.cuda.get_device_name(local_rank)
        memory = torch.cuda.get_device_properties(local_rank).total_memory
    return RankIdentity(rank=rank, node=node, local_rank=local_rank, local_world=local_world, gpu_name=name,
                        gpu_memory_bytes=memory, device=device)


def exchange_identities(cluster: Cluster, *, on_cuda: bool) -> list[RankIdentity]:
    """Every rank's identity (collective: one ``all_gather_object``), by global rank."""
    import torch.distributed as dist

    world = dist.get_world_size()
    mine = my_identity(cluster, rank=dist.get_rank(), world=world, on_cuda=on_cuda)
    gathered: list[RankIdentity | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    return [i for i in gathered if i is not None]


def gather_entries(entry: PlacementEntry) -> list[PlacementEntry]:
    """Every rank's :class:`PlacementEntry` (collective), by global rank."""
    import torch.distributed as dist

    gathered: list[PlacementEntry | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry)
    return sorted((e for e in gathered if e is not None), key=lambda e: e.rank)


_REPORTED: list[PlacementEntry] = []


def report(entries: Sequence[PlacementEntry]) -> None:
    """Keep what this process's ranks reported (one rank per process) for the launcher to return."""
    _REPORTED[:] = entries


def reported() -> list[PlacementEntry]:
    """The placement the last :func:`report` kept (empty before any rank was set up)."""
    return list(_REPORTED)
