"""Turn a validated :class:`ClusterFile` into a :class:`Cluster`, checking cross-references."""

from __future__ import annotations

import fnmatch
from dataclasses import replace

from medley.errors import MedleyInputError
from medley.spec.catalog import DeviceType, catalog_entry, get_device_type
from medley.spec.cluster import DEFAULT_LINK_LATENCY_US, Cluster, Device, Node, NodeLink, Tier
from medley.spec.cluster_schema import ClusterFile, NodeSpec, TierSpec

PCIE_DEFAULT_GBPS = 32.0  # Gen4 x16 per direction, when a node overrides the catalog's link kind to pcie


def _fail(source: str, where: str, problem: str, fix: str) -> MedleyInputError:
    return MedleyInputError(f"{source}: field '{where}': {problem}; fix: {fix}.")


def _override(base: DeviceType, name: str, memory_gb: float | None, tflops: float | None) -> DeviceType:
    if memory_gb is None and tflops is None:
        return base
    return replace(
        base,
        name=name,
        aliases=(),
        memory_gb=memory_gb or base.memory_gb,
        peak_tflops_half=tflops or base.peak_tflops_half,
    )


def _link(spec: NodeSpec, base: DeviceType, source: str, where: str) -> NodeLink:
    kind = spec.link.kind or base.intra_node_link
    bandwidth = spec.link.bandwidth_gbps
    if bandwidth is None:
        if kind == base.intra_node_link:
            bandwidth = base.intra_node_bandwidth_gbps
        elif kind == "pcie":
            bandwidth = PCIE_DEFAULT_GBPS
        else:
            raise _fail(
                source,
                f"{where}.link.bandwidth_gbps",
                f"{base.name} has no NVLink in the catalog",
                "give the link's bandwidth_gbps",
            )
    latency = spec.link.latency_us if spec.link.latency_us is not None else DEFAULT_LINK_LATENCY_US[kind]
    return NodeLink(kind=kind, bandwidth_gbps=bandwidth, latency_us=latency)


def _node_devices(
    spec: NodeSpec, name: str, base: DeviceType, first_id: int, source: str, where: str
) -> list[Device]:
    node_type = _override(base, f"{base.name}@{name}", spec.memory_gb, spec.tflops)
    devices = [
        Device(id=first_id + r, node=name, local_rank=r, type=node_type, price_per_hour=spec.price_per_hour)
        for r in range(spec.count)
    ]
    seen: set[int] = set()
    for k, ov in enumerate(spec.devices):
        field_name = f"{where}.devices[{k}].local_rank"
        if ov.local_rank >= spec.count:
            raise _fail(
                source,
                field_name,
                f"local_rank {ov.local_rank} but the node has {spec.count} devices",
                f"use 0..{spec.count - 1}",
            )
        if ov.local_rank in seen:
            raise _fail(
                source, field_name, f"local_rank {ov.local_rank} is overridden twice", "merge the entries"
            )
        seen.add(ov.local_rank)
        old = devices[ov.local_rank]
        dtype = _override(node_type, f"{base.name}@{name}/{ov.local_rank}", ov.memory_gb, ov.tflops)
        price = ov.price_per_hour if ov.price_per_hour is not None else old.price_per_hour
        devices[ov.local_rank] = replace(old, type=dtype, price_per_hour=price)
    return devices


def _expand(member: str, known: list[str]) -> list[str]:
    if any(c in member for c in "*?["):
        return fnmatch.filter(known, member)
    return [member] if member in known else []


def _tier_groups(
    tier: TierSpec, j: int, members: list[str], source: str, what: str
) -> dict[str, tuple[str, ...]]:
    """Group name -> members of the level below; every member in exactly one group."""
    if tier.groups is None:
        return {tier.name: tuple(members)}
    owner: dict[str, str] = {}
    groups: dict[str, tuple[str, ...]] = {}
    for group, listed in tier.groups.items():
        where = f"tiers[{j}].groups.{group}"
        expanded: list[str] = []
        for member in listed:
            found = _expand(member, members)
            if not found:
                raise _fail(
                    source,
                    where,
                    f"'{member}' is not one of the {what} ({', '.join(members[:8])}"
                    f"{', ...' if len(members) > 8 else ''})",
                    f"list {what} only, or fix the name",
                )
            expanded += found
        for member in expanded:
            if member in owner and owner[member] != group:
                raise _fail(
                    source,
                    where,
                    f"'{member}' is also in group '{owner[member]}'",
                    "put each member in exactly one group of a tier",
                )
            owner[member] = group
        if not expanded:
            raise _fail(source, where, "the group is empty", "list at least one member")
        groups[group] = tuple(dict.fromkeys(expanded))
    missing = [m for m in members if m not in owner]
    if missing:
        raise _fail(
            source,
            f"tiers[{j}].groups",
            f"'{missing[0]}' is in no group of tier '{tier.name}'",
            "add it to a group (or omit `groups` to put everything in one)",
        )
    return groups


def _tier_pairs(
    tier: TierSpec, j: int, groups: dict[str, tuple[str, ...]], source: str
) -> dict[frozenset[str], tuple[float, float]]:
    group_of = {m: g for g, ms in groups.items() for m in ms}
    pairs: dict[frozenset[str], tuple[float, float]] = {}
    for k, pair in enumerate(tier.pairs):
        a, b = pair.between
        for name in (a, b):
            if name not in group_of:
                raise _fail(
                    source,
                    f"tiers[{j}].pairs[{k}].between",
                    f"'{name}' is not a member of tier '{tier.name}'",
                    f"name members it joins: {', '.join(list(group_of)[:8])}",
                )
        if a == b or group_of[a] != group_of[b]:
            raise _fail(
                source,
                f"tiers[{j}].pairs[{k}].between",
                f"'{a}' and '{b}' do not meet at this tier",
                "name two different members of the same group",
            )
        latency = pair.latency_us if pair.latency_us is not None else tier.latency_us
        pairs[frozenset((a, b))] = (pair.bandwidth_gbps, latency)
    return pairs


def _build_tiers(
    tier_specs: list[TierSpec], node_names: list[str], source: str
) -> tuple[list[Tier], dict[str, list[str]]]:
    """The tiers and, per node, its group at every tier."""
    if len(node_names) > 1 and not tier_specs:
        raise _fail(
            source,
            "tiers",
            f"{len(node_names)} nodes but no network tier",
            'add [[tiers]] with name and bandwidth_gbps (e.g. name = "ethernet", bandwidth_gbit = 25)',
        )
    tiers: list[Tier] = []
    paths: dict[str, list[str]] = {n: [] for n in node_names}
    members, what = list(node_names), "nodes"
    for j, spec in enumerate(tier_specs):
        if spec.name in (t.name for t in tiers):
            raise _fail(source, f"tiers[{j}].name", f"tier name '{spec.name}' is used twice", "rename one")
        groups = _tier_groups(spec, j, members, source, what)
        group_of = {m: g for g, ms in groups.items() for m in ms}
        for node, path in paths.items():
            path.append(group_of[path[-1] if path else node])
        tiers.append(
            Tier(
                name=spec.name,
                bandwidth_gbps=spec.bandwidth_gbps,
                latency_us=spec.latency_us,
                groups=groups,
                pairs=_tier_pairs(spec, j, groups, source),
            )
        )
        members, what = list(groups), f"groups of tier '{spec.name}'"
    if len(members) > 1:
        raise _fail(
            source,
            f"tiers[{len(tiers) - 1}]",
            f"the outermost tier leaves {len(members)} separate groups that cannot reach each other",
            "add an outer tier without `groups` to join them",
        )
    return tiers, paths


def build_cluster(spec: ClusterFile, *, source: str, catalog: dict[str, DeviceType]) -> Cluster:
    """Expand repeated nodes, resolve device types and overrides, and check tiers, groups and pairs."""
    devices: list[Device] = []
    node_rows: list[tuple[str, tuple[int, ...], NodeLink, str | None]] = []
    seen: dict[str, str] = {}
    used: dict[str, DeviceType] = {}
    for i, node_spec in enumerate(spec.nodes):
        where = f"nodes[{i}]"
        try:
            base = get_device_type(node_spec.device, catalog)
        except MedleyInputError as err:
            raise MedleyInputError(f"{source}: field '{where}.device': {err}") from None
        used[base.name] = base
        names = (
            [node_spec.name]
            if node_spec.repeat == 1
            else [f"{node_spec.name}-{r}" for r in range(node_spec.repeat)]
        )
        for copy, name in enumerate(names):
            if name in seen:
                raise _fail(
                    source,
                    f"{where}.name",
                    f"duplicate node name '{name}' (also {seen[name]})",
                    "give every node a unique name",
                )
            seen[name] = where
            node_devices = _node_devices(node_spec, name, base, len(devices), source, where)
            devices += node_devices
            node_rows.append((name, tuple(d.id for d in node_devices), _link(node_spec, base, source, where),
                              node_spec.host_of(copy)))
    tiers, paths = _build_tiers(spec.tiers, [row[0] for row in node_rows], source)
    nodes = [
        Node(name=name, device_ids=ids, link=link, groups=tuple(paths[name]), host=host)
        for name, ids, link, host in node_rows
    ]
    # What a plan embeds: the spec with its device types whole instead of a catalog file's path.
    embedded = spec.model_dump(mode="json", exclude_none=True, exclude={"catalog"})
    embedded["device_types"] = {name: catalog_entry(t) for name, t in used.items()}
    return Cluster(
        name=spec.name,
        devices=devices,
        nodes=nodes,
        tiers=tiers,
        source_spec=embedded,
    )
