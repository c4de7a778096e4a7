"""Reading a cluster: a TOML file, a plan file's ``[cluster]`` table, or a short form like
``8xA100-80GB+4xV100-32GB`` (:mod:`medley.spec.cluster` holds the types,
:mod:`medley.spec.cluster_build` checks and builds them)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ValidationError

from medley.errors import MedleyInputError
from medley.fileio import read_toml
from medley.spec.catalog import DeviceType, get_device_type, load_catalog, with_entries
from medley.spec.cluster import DEFAULT_NETWORK_GBPS, DEFAULT_NETWORK_LATENCY_US, Cluster
from medley.spec.cluster_build import build_cluster
from medley.spec.cluster_schema import ClusterFile, describe_validation_error, printable
from medley.spec.limits import MAX_DEVICES


def load_cluster(path: Path, catalog: dict[str, DeviceType] | None = None) -> Cluster:
    """Read and validate a cluster TOML file; every problem is a :class:`MedleyInputError`."""
    path = Path(path)
    raw = read_toml(path, what="cluster")
    try:
        spec = ClusterFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, str(path))) from None
    if spec.catalog is not None:
        catalog = load_catalog(path.parent / spec.catalog)
        spec = spec.model_copy(update={"catalog": str((path.parent / spec.catalog).resolve())})
    catalog = catalog or load_catalog()
    return _with_types(spec, source=str(path), catalog=catalog)


def cluster_from_dict(raw: dict, *, source: str) -> Cluster:
    """A cluster from already-parsed TOML contents (a plan file's ``[cluster]`` table)."""
    try:
        spec = ClusterFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, source)) from None
    # A plan stores its device types (device_types); an older one names a catalog file instead.
    catalog = load_catalog(Path(spec.catalog)) if spec.catalog is not None and not spec.device_types \
        else load_catalog()
    return _with_types(spec, source=source, catalog=catalog)


def _with_types(spec: ClusterFile, *, source: str, catalog: dict[str, DeviceType]) -> Cluster:
    """The cluster of ``spec`` with its ``device_types`` over ``catalog``; an entry that no node
    uses is refused: a renamed entry (a slip while editing a plan) would leave its node on the
    catalog's type of the old name without a word."""
    if not spec.device_types:
        return build_cluster(spec, source=source, catalog=catalog)
    catalog = with_entries(catalog, spec.device_types, source=source)
    cluster = build_cluster(spec, source=source, catalog=catalog)
    types = sorted({get_device_type(node.device, catalog).name for node in spec.nodes})
    unused = [name for name in spec.device_types if get_device_type(name, catalog).name not in types]
    if unused:
        raise MedleyInputError(printable(
            f"{source}: field 'device_types.{unused[0]}': no node uses this device type (the nodes use "
            f"{', '.join(types)}); name it in a node's `device`, or remove the entry"))
    return cluster


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
    try:
        spec = ClusterFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, f"cluster '{printable(text)}'")) from None
    return build_cluster(spec, source=f"cluster '{printable(text)}'", catalog=catalog or load_catalog())
