"""Measured links per network tier (``medley profile --comm`` under torchrun), and a cluster
whose nominal links they replace (``--comm-profile FILE`` of plan, show and simulate).

The file (JSON, ``format = "medley-comm-profile"``, ``version = 1``) holds, per measured link, the
tier (``intra-node`` for ranks of one node, ``inter-node`` for one rank per node), the nodes it
covered (as the ranks named them: ``MEDLEY_NODE``, else the host name), the raw timings and their
α-β fit (:mod:`medley.profile.comm_bench` has the model). :func:`apply_comm_profile` puts the fits
into a cluster: an intra-node fit becomes the link of each node it covered, an inter-node fit the
bandwidth and latency of the innermost tier joining its nodes. Links it did not measure keep the
cluster file's figures. A node it names that the cluster lacks (by name or ``host``) is an error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from medley.cost.profile_format import AlphaBeta, CommMeasurement, read_versioned_json
from medley.errors import MedleyInputError
from medley.fileio import write_atomically
from medley.spec.cluster import Cluster, NodeLink
from medley.spec.cluster_schema import STRICT, describe_validation_error, printable

COMM_PROFILE_FORMAT = "medley-comm-profile"
COMM_PROFILE_VERSION = 1
COMM_DOC = ("the module docstring of medley/cost/comm_profile.py (re-create the file with "
            "`medley profile --comm`)")


class TierLink(BaseModel):
    """One measured link: its tier, the nodes it covered, the timings and their α-β fit."""

    model_config = STRICT
    tier: Literal["intra-node", "inter-node"]
    nodes: list[str] = Field(min_length=1)
    ranks: int = Field(ge=2)
    fit: AlphaBeta
    measurements: list[CommMeasurement] = Field(min_length=1)


class CommTierProfile(BaseModel):
    model_config = STRICT
    format: Literal["medley-comm-profile"]
    version: int
    created: str
    backend: str
    world_size: int = Field(ge=2)
    ranks_per_node: dict[str, int]
    links: list[TierLink]


def save_comm_profile(profile: CommTierProfile, path: Path) -> None:
    write_atomically(Path(path), json.dumps(profile.model_dump(mode="json"), indent=1) + "\n")


def load_comm_profile(path: Path) -> CommTierProfile:
    """Read and validate ``--comm-profile FILE``; every problem is one :class:`MedleyInputError` line."""
    raw = read_versioned_json(path, what="communication profile", flag="--comm-profile",
                              file_format=COMM_PROFILE_FORMAT, version=COMM_PROFILE_VERSION,
                              writer="medley profile --comm")
    try:
        return CommTierProfile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, str(path), doc=COMM_DOC)) from None


def _cluster_node(cluster: Cluster, name: str, path: Path) -> str:
    for node in cluster.nodes:
        if name in (node.name, node.host):
            return node.name
    known = ", ".join(n.name for n in cluster.nodes[:8]) + (" ..." if len(cluster.nodes) > 8 else "")
    raise MedleyInputError(
        f"--comm-profile {path}: measured node '{printable(name)}', which cluster "
        f"'{printable(cluster.name)}' has neither as a node name nor as a host (nodes: {known}); measure "
        "with MEDLEY_NODE set to the cluster's node names."
    )


def apply_comm_profile(cluster: Cluster, profile: CommTierProfile, *, path: Path) -> Cluster:
    """``cluster`` with the links ``profile`` measured in place of the nominal ones (module docstring)."""
    nodes = {n.name: n for n in cluster.nodes}
    tiers = list(cluster.tiers)
    for link in profile.links:
        names = [_cluster_node(cluster, n, path) for n in link.nodes]
        gbps, us = link.fit.bandwidth_bytes_per_s / 1e9, link.fit.latency_s * 1e6
        if link.tier == "intra-node":
            for name in names:
                old = nodes[name].link
                nodes[name] = dataclasses.replace(
                    nodes[name], link=NodeLink(kind=old.kind, bandwidth_gbps=gbps, latency_us=us))
            continue
        joining = {cluster.meeting_tier(a, b) for i, a in enumerate(names) for b in names[i + 1:]}
        if joining and min(joining) >= 0:
            j = min(joining)
            tiers[j] = dataclasses.replace(tiers[j], bandwidth_gbps=gbps, latency_us=us)
    return Cluster(name=cluster.name, devices=cluster.devices, nodes=[nodes[n.name] for n in cluster.nodes],
                   tiers=tiers, source_spec=cluster.source_spec)
