"""A concrete cluster: devices with global ids, nodes, intra-node links and network tiers.

Read from TOML (:func:`load_cluster`, format in docs/cluster-format.md) or from a short form
(:func:`parse_cluster_arg`). Tiers are ordered innermost first; two nodes talk over the first tier
whose group holds both, at the slowest bandwidth of the tiers up to and including that one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from medley.errors import MedleyInputError
from medley.fileio import read_toml
from medley.spec.catalog import DeviceType, load_catalog
from medley.spec.cluster_schema import ClusterFile, describe_validation_error, printable
from medley.spec.limits import MAX_DEVICES

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

    def device_types(self) -> dict[str, DeviceType]:
        """Distinct device types present (override-renamed types included), name -> type."""
        return {device.type.name: device.type for device in self.devices}

    def devices_by_type(self) -> dict[str, list[int]]:
        result: dict[str, list[int]] = {}
        for device in self.devices:
            result.setdefault(device.type.name, []).append(device.id)
        return result

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


def load_cluster(path: Path, catalog: dict[str, DeviceType] | None = None) -> Cluster:
    """Read and validate a cluster TOML file; every problem is a :class:`MedleyInputError`."""
    path = Path(path)
    raw = read_toml(path, what="cluster")
    try:
        spec = ClusterFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, str(path))) from None
    from medley.spec.cluster_build import build_cluster

    if spec.catalog is not None:
        catalog = load_catalog(path.parent / spec.catalog)
        spec = spec.model_copy(update={"catalog": str((path.parent / spec.catalog).resolve())})
    return build_cluster(spec, source=str(path), catalog=catalog or load_catalog())


def cluster_from_dict(raw: dict, *, source: str) -> Cluster:
    """A cluster from already-parsed TOML contents (a plan file's ``[cluster]`` table)."""
    try:
        spec = ClusterFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, source)) from None
    from medley.spec.cluster_build import build_cluster

    catalog = load_catalog(Path(spec.catalog)) if spec.catalog is not None else load_catalog()
    return build_cluster(spec, source=source, catalog=catalog)


def _short_count(digits: str) -> int:
    """A short form's device count, checked against the limit before any device is built (a count
    too long to convert stands for "over the limit")."""
    return int(digits) if len(digits) <= len(str(MAX_DEVICES)) else MAX_DEVICES + 1


_SHORT_FORM = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9_.\-]+)\s*$")


def parse_cluster_arg(text: str, catalog: dict[str, DeviceType] | None = None) -> Cluster:
    """A cluster TOML path, or a short form: ``8xA100-80GB`` (one node) or
    ``4xA100-80GB+4xV100-32GB`` (one node per term, joined by a 100 Gb/s, 10 µs network)."""
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        return load_cluster(path, catalog)
    terms = [m for m in (_SHORT_FORM.match(term) for term in text.split("+")) if m]
    if len(terms) != len(text.split("+")):
        raise MedleyInputError(
            f"cluster '{printable(text)}': not a file and not of the form COUNTxTYPE[+COUNTxTYPE...] "
            f"(e.g. 8xA100-80GB+4xT4-16GB); give a cluster TOML path or fix the form."
        )
    counts = [_short_count(m[1]) for m in terms]
    if sum(counts) > MAX_DEVICES:
        raise MedleyInputError(
            f"cluster '{printable(text)}': {'+'.join(m[1] for m in terms)} devices; the limit is "
            f"{MAX_DEVICES:,} devices per cluster: use fewer."
        )
    raw = {
        "name": text,
        "nodes": [
            {"name": f"node{i}", "device": m[2], "count": n}
            for i, (m, n) in enumerate(zip(terms, counts, strict=True))
        ],
        "tiers": [
            {
                "name": "network",
                "bandwidth_gbps": DEFAULT_NETWORK_GBPS,
                "latency_us": DEFAULT_NETWORK_LATENCY_US,
            }
        ]
        if len(terms) > 1
        else [],
    }
    from medley.spec.cluster_build import build_cluster

    try:
        spec = ClusterFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, f"cluster '{printable(text)}'")) from None
    return build_cluster(spec, source=f"cluster '{printable(text)}'", catalog=catalog or load_catalog())
