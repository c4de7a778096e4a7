"""α-β communication times over a cluster's topology (implements :class:`CommModel`).

Point-to-point: latency + bytes / bandwidth of the link the pair shares (the node link inside a
node; across nodes the slowest tier crossed, see :meth:`Cluster.node_pair_link`).

Collectives use ring algorithms, timed two ways and the faster one kept:
- flat: one ring over all devices, paced by its slowest hop and paying the worst latency per step;
- hierarchical (groups spanning several nodes): reduce-scatter inside each node, then the
  inter-node phase over 1/k of the data on each of the k devices per node (k rings sharing each
  node's network, so a node moves the whole buffer's share), then all-gather inside each node.
A node's network bandwidth is per node, per direction, as the cluster file gives it.
Tiers between racks and zones are not modelled as shared (no oversubscription): rough.
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.cost.interfaces import Collective
from medley.spec.cluster import Cluster

_US = 1e-6
_GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class _Phase:
    """A ring over ``size`` participants per ring at ``bandwidth`` bytes/s and ``latency`` s per step."""

    size: int
    bandwidth: float
    latency: float

    def reduce_scatter(self, nbytes: float) -> float:
        """Also the all-gather time: each participant moves (size-1)/size of the buffer."""
        if self.size <= 1:
            return 0.0
        steps = self.size - 1
        return steps * self.latency + steps / self.size * nbytes / self.bandwidth


@dataclass(frozen=True, kw_only=True, slots=True)
class _GroupShape:
    flat: _Phase
    intra: _Phase | None  # None for single-node groups: the flat ring is the intra-node ring
    inter: _Phase | None


class TopologyCommModel:
    """Times transfers and collectives between global device ids of ``cluster``."""

    def __init__(self, cluster: Cluster, *, p2p_overhead_s: float = 0.0) -> None:
        """``p2p_overhead_s``: added to every transfer between two devices (the runtime's hand-off
        beyond the link, measured by ``medley profile``; 0 when unknown)."""
        self.cluster = cluster
        self.p2p_overhead_s = p2p_overhead_s
        self._shapes: dict[tuple[int, ...], _GroupShape] = {}
        self._node_links: dict[tuple[str, str], tuple[float, float]] = {}

    def _node_link(self, a: str, b: str) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) between two nodes (or inside one when a == b)."""
        key = (a, b) if a <= b else (b, a)
        if key not in self._node_links:
            if a == b:
                link = self.cluster.node(a).link
                gbps, us = link.bandwidth_gbps, link.latency_us
            else:
                gbps, us = self.cluster.node_pair_link(a, b)
            self._node_links[key] = (gbps * _GB, us * _US)
        return self._node_links[key]

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst:
            return 0.0
        bandwidth, latency = self._node_link(self.cluster.devices[src].node, self.cluster.devices[dst].node)
        return latency + nbytes / bandwidth + self.p2p_overhead_s

    def _shape(self, devices: tuple[int, ...]) -> _GroupShape:
        cached = self._shapes.get(devices)  # callers repeat the same tuples; skip the sort then
        if cached is not None:
            return cached
        key = tuple(sorted(set(devices)))
        if key in self._shapes:
            self._shapes[devices] = self._shapes[key]
            return self._shapes[key]
        per_node: dict[str, int] = {}
        for device in key:
            node = self.cluster.devices[device].node
            per_node[node] = per_node.get(node, 0) + 1
        nodes = list(per_node)
        busy = [n for n in nodes if per_node[n] > 1]
        intra = [self._node_link(n, n) for n in busy]
        inter = [self._node_link(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1 :]]
        hops = intra + inter or [(float("inf"), 0.0)]  # a single device: nothing to move
        flat = _Phase(size=len(key), bandwidth=min(b for b, _ in hops), latency=max(t for _, t in hops))
        shape = _GroupShape(flat=flat, intra=None, inter=None)
        if len(nodes) > 1:
            intra_phase = (
                _Phase(
                    size=max(per_node.values()),
                    bandwidth=min(b for b, _ in intra),
                    latency=max(t for _, t in intra),
                )
                if intra
                else None
            )
            inter_phase = _Phase(
                size=len(nodes), bandwidth=min(b for b, _ in inter), latency=max(t for _, t in inter)
            )
            shape = _GroupShape(flat=flat, intra=intra_phase, inter=inter_phase)
        self._shapes[key] = self._shapes[devices] = shape
        return shape

    def collective_time(self, op: Collective, devices: tuple[int, ...], nbytes: float) -> float:
        """Time of ``op`` over ``devices``; ``nbytes`` is the full (unsharded) buffer size."""
        shape = self._shape(devices)
        if shape.flat.size <= 1:
            return 0.0
        passes = 2 if op is Collective.ALL_REDUCE else 1  # all-reduce = reduce-scatter + all-gather
        flat = passes * shape.flat.reduce_scatter(nbytes)
        if shape.inter is None:
            return flat
        intra = 0.0 if shape.intra is None else shape.intra.reduce_scatter(nbytes)
        # The inter-node ring carries 1/k of the buffer per device, k of them through each node:
        # per node that is the whole buffer's (n-1)/n, as in a ring over nodes of nbytes.
        hierarchical = passes * (intra + shape.inter.reduce_scatter(nbytes))
        return min(flat, hierarchical)

    def path_links(self, src: int, dst: int) -> tuple[str, ...]:
        """Shared links from src to dst: device ports, and each node's network port when leaving it.

        Names: ``dev:<id>:tx``/``dev:<id>:rx`` and ``node:<name>:nic:tx``/``node:<name>:nic:rx``.
        """
        if src == dst:
            return ()
        a, b = self.cluster.devices[src].node, self.cluster.devices[dst].node
        if a == b:
            return (f"dev:{src}:tx", f"dev:{dst}:rx")
        return (f"dev:{src}:tx", f"node:{a}:nic:tx", f"node:{b}:nic:rx", f"dev:{dst}:rx")

    def link_bandwidth(self, link: str) -> float:
        """Capacity of a link named by :meth:`path_links`, in bytes/s."""
        kind, name, *rest = link.split(":")
        if kind == "dev":
            node = self.cluster.devices[int(name)].node
            return self._node_link(node, node)[0]
        if kind == "node" and rest and rest[0] == "nic":
            tiers = self.cluster.tiers
            return (tiers[0].bandwidth_gbps if tiers else float("inf")) * _GB
        raise KeyError(f"unknown link name {link!r}")
