"""An emulated heterogeneous cluster on this machine's CPU, and the costs that predict it.

medley's runtime emulates unlike devices on like ones (``TrainConfig.of(emulate=True)``): each rank
sleeps ``(factor - 1) x`` the measured time of every compute action, where ``factor`` is the
plan's fastest device peak over the rank's own (:mod:`medley.runtime.emulated_devices`). This module makes
the matching plan inputs from a CPU profile:

* a :class:`Cluster` of N CPU ranks whose device types (``CPU-x1``, ``CPU-x2``, ...) have the
  profiled CPU's peaks divided by each rank's slowdown, one single-device node per rank (or per
  tensor-parallel group: ``node_sizes`` consecutive devices of one slowdown) joined by a
  "loopback" tier with the gloo α-β fitted for that group size (so every pair and every ring is
  timed with the measured latency and bandwidth);
* a :class:`ProfileCostSource` whose times for each of those types are the profile's times times
  the slowdown (and times ``compute_share``, below).

``compute_share``: ranks are processes sharing the machine's cores. With more ranks than cores
(4 ranks on 2 cores here) the ranks that compute at the same time share the cores and each runs
slower; the simulator models devices as independent, so the caller may pass the expected
stretch (at most ranks / cores). This is an approximation of the emulation, stated in reports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from medley.cost.estimator import CatalogCostSource
from medley.cost.profile_format import Profile
from medley.cost.profiles import ProfileCostSource
from medley.fileio import write_atomically
from medley.spec.catalog import get_device_type, load_catalog
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model import ModelSpec


def core_share(
    slowdowns: Sequence[float], *, cores: int | None = None, background_cores: float = 0.0
) -> float:
    """How much each rank's compute stretches when the ranks' processes share ``cores``.

    A rank demands a core for the whole step except while it sleeps to emulate a slower device:
    waiting is not free here (measured: four tiny-model pipeline ranks on two cores used 1.75
    cores, each about twice its profiled compute, the rest being gloo's loopback copies, wake-ups
    and the executor). So with more demand than cores every rank's compute is stretched by
    (Σ 1/slowdown + background) / cores, and not at all below that."""
    cores = cores or max(1, len(os.sched_getaffinity(0)))
    return max(1.0, (sum(1.0 / f for f in slowdowns) + background_cores) / cores)


def emulated_type_name(factor: float) -> str:
    return f"CPU-x{factor:g}"


@dataclass(frozen=True, kw_only=True)
class EmulatedCluster:
    """A cluster of emulated CPU devices and the cost source that predicts runs on it.

    Attributes:
        cluster: device ``i`` is rank-device ``i`` with slowdown ``slowdowns[i]``.
        cost: profile times scaled per device type (catalog fallback for what the profile lacks).
        slowdowns: per device id.
        catalog_path: the device catalog file the cluster's types are defined in.
    """

    cluster: Cluster
    cost: ProfileCostSource
    slowdowns: tuple[float, ...]
    catalog_path: Path


def _catalog(profile: Profile, factors: Sequence[float], link_gbps: float) -> dict:
    base = get_device_type(profile.device_type, load_catalog())
    entries = {}
    for factor in sorted(set(factors)):
        entries[emulated_type_name(factor)] = {
            "peak_tflops_half": base.peak_tflops_half / factor,
            "peak_tflops_fp32": base.peak_tflops_fp32 / factor,
            "memory_gb": base.memory_gb,
            "memory_bandwidth_gbps": base.memory_bandwidth_gbps / factor,
            "intra_node_link": "pcie",
            "intra_node_bandwidth_gbps": link_gbps,
            "supports_bf16": base.supports_bf16,
            "confidence": "low",
        }
    return {"devices": entries}


def _node_slices(slowdowns: Sequence[float], node_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(first device, device count) of each node: ``node_sizes`` in id order, else one per device."""
    sizes = list(node_sizes) or [1] * len(slowdowns)
    if sum(sizes) != len(slowdowns) or min(sizes) < 1:
        raise ValueError(f"node sizes {tuple(sizes)} do not cover the {len(slowdowns)} devices")
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    for first, size in zip(firsts, sizes, strict=True):
        if len(set(slowdowns[first:first + size])) > 1:
            raise ValueError(f"devices {first}..{first + size - 1} share a node but not a slowdown "
                             f"({tuple(slowdowns[first:first + size])}): a node holds one device type")
    return list(zip(firsts, sizes, strict=True))


def emulated_cluster(
    profile: Profile, model: ModelSpec, slowdowns: Sequence[float], *, directory: Path, profile_name: str,
    compute_share: float = 1.0, name: str = "emulated-cpu", node_sizes: Sequence[int] = (),
) -> EmulatedCluster:
    """Cluster and costs of ``len(slowdowns)`` CPU ranks; writes the device catalog to ``directory``.
    ``node_sizes``: devices per node in id order (default one each), so that a TP group's devices
    share a node; a node's devices must have one slowdown (one device type)."""
    if not slowdowns or min(slowdowns) < 1.0:
        raise ValueError(f"slowdowns must be >= 1 (1 = full speed), got {tuple(slowdowns)}")
    nodes = _node_slices(slowdowns, node_sizes)
    if profile.comm is None:
        raise ValueError("the profile has no collective measurements; profile with --comm-ranks")
    link = profile.comm.link_for(len(slowdowns))
    link_gbps = link.bandwidth_bytes_per_s / 1e9
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    catalog_path = directory.resolve() / f"{name}-devices.toml"  # the file itself: a link there is replaced
    write_atomically(catalog_path, tomli_w.dumps(_catalog(profile, slowdowns, link_gbps)))
    spec = {
        "name": name,
        "catalog": str(catalog_path),
        "nodes": [{"name": f"rank{first}" if size == 1 else f"ranks{first}-{first + size - 1}",
                   "device": emulated_type_name(slowdowns[first]), "count": size,
                   "link": {"kind": "pcie", "bandwidth_gbps": link_gbps, "latency_us": link.latency_s * 1e6}}
                  for first, size in nodes],
        "tiers": [{"name": "loopback", "bandwidth_gbps": link_gbps, "latency_us": link.latency_s * 1e6}]
        if len(slowdowns) > 1 else [],
    }
    cluster = cluster_from_dict(spec, source=f"emulated cluster '{name}'")
    scale = {emulated_type_name(f): f * compute_share for f in slowdowns}
    fallback = CatalogCostSource.for_cluster(model, cluster, dtype=profile.dtype)
    cost = ProfileCostSource(profile=profile, name=profile_name, model=model, fallback=fallback,
                             device_scale=scale)
    return EmulatedCluster(cluster=cluster, cost=cost, slowdowns=tuple(float(f) for f in slowdowns),
                           catalog_path=catalog_path)
