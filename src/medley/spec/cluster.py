"""A concrete cluster: devices with global ids, nodes, intra-node links and network tiers.

Read (:mod:`medley.spec.cluster_load`) from TOML (format in docs/cluster-format.md) or from a short form
like ``8xA100-80GB``. Tiers are ordered innermost first; two nodes talk over the first tier
whose group holds both, at the slowest bandwidth of the tiers up to and including that one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from medley.spec.catalog import DeviceType

DEFAULT_LINK_LATENCY_US = {"nvlink": 2.0, "pcie": 5.0}
# Short-form clusters with several nodes ("4xA100-80GB+4xV100-32GB") use a 100 Gb/s network.
DEFAULT_NETWORK_GBPS = 12.5
DEFAULT_NETWORK_LATENCY_US = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One accelerator. ``type`` carries per-node/per-device overrides (then named ``BASE@node``)."""

    id: int
    node: str
    local_rank: int
    type: DeviceType
    price_per_hour: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeLink:
    kind: str
    bandwidth_gbps: float
    latency_us: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """A machine. ``groups[j]`` is the group of tier j it belongs to; ``host`` its host name or
    address where the cluster file gives one (``medley launch`` uses it for the rendezvous)."""

    name: str
    device_ids: tuple[int, ...]
    link: NodeLink
    groups: tuple[str, ...]
    host: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Tier:
    """A network level. ``pairs`` overrides (bandwidth, latency) between two members of one group."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    groups: dict[str, tuple[str, ...]]
    pairs: dict[frozenset[str], tuple[float, float]] = field(default_factory=dict)


@dataclass(kw_only=True)
class Cluster:
    """Devices (ids 0..N-1 in file order), the nodes holding them and the network tiers joining nodes."""

    name: str
    devices: list[Device]
    nodes: list[Node]
    tiers: list[Tier]
    # The validated file contents it was built from, so that a plan file can carry its cluster.
    source_spec: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._node_by_name = {node.name: node for node in self.nodes}

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def node(self, name: str) -> Node:
        return self._node_by_name[name]

    def device_types(self, ids: Iterable[int] | None = None) -> dict[str, DeviceType]:
        """Distinct device types present (override-renamed types included), name -> type; of
        the devices ``ids`` only, when given."""
        devices = self.devices if ids is None else [self.devices[d] for d in ids]
        return {device.type.name: device.type for device in devices}

    def devices_by_type(self, ids: Iterable[int] | None = None) -> dict[str, list[int]]:
        """Device ids by type name, types and ids in id order (only ``ids``, when given)."""
        result: dict[str, list[int]] = {}
        for d in range(len(self.devices)) if ids is None else sorted(ids):
            result.setdefault(self.devices[d].type.name, []).append(d)
        return result

    def one_node_one_type(self, ids: Iterable[int]) -> bool:
        """Whether the devices ``ids`` all sit on one node and are of one type (a TP group)."""
        members = [self.devices[d] for d in ids]
        return len({d.node for d in members}) <= 1 and len({d.type.name for d in members}) <= 1

    def meeting_tier(self, node_a: str, node_b: str) -> int:
        """Index of the innermost tier whose group holds both nodes (-1: the same node)."""
        if node_a == node_b:
            return -1
        a, b = self.node(node_a).groups, self.node(node_b).groups
        return next(j for j in range(len(self.tiers)) if a[j] == b[j])

    def node_pair_link(self, node_a: str, node_b: str) -> tuple[float, float]:
        """(bandwidth GB/s, latency µs) between two distinct nodes."""
        j = self.meeting_tier(node_a, node_b)
        tier = self.tiers[j]
        # The inner tiers are crossed on the way up to tier j; the slowest link sets the pace.
        bandwidth = min((t.bandwidth_gbps for t in self.tiers[:j]), default=float("inf"))
        members = frozenset((self._member(node_a, j), self._member(node_b, j)))
        override = tier.pairs.get(members)
        tier_bw, latency = override if override else (tier.bandwidth_gbps, tier.latency_us)
        return min(bandwidth, tier_bw), latency

    def _member(self, node: str, tier: int) -> str:
        """What stands for ``node`` among the members of tier ``tier``'s groups."""
        return node if tier <= 0 else self.node(node).groups[tier - 1]

    def total_tflops(self, dtype: str = "bf16") -> float:
        return sum(d.type.peak_flops(dtype) for d in self.devices) / 1e12

    def total_memory_gb(self) -> float:
        return sum(d.type.memory_gb for d in self.devices)
