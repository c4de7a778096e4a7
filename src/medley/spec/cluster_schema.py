"""The cluster TOML schema (pydantic) and its error messages. docs/cluster-format.md describes it.

Types are strict: a boolean or a string is never read as a number, an integer field refuses 3.0,
and floats must be finite. Sizes are bounded (:mod:`medley.spec.limits`) before anything is built.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from medley.spec.limits import MAX_DEVICES

DEFAULT_TIER_LATENCY_US = 25.0
_HOST = r"^[A-Za-z0-9_.:\-\[\]]+$"  # a host name, IPv4 or [IPv6] address
CLUSTER_DOC = "docs/cluster-format.md"
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""The configuration of every user-file schema: no unknown keys, no coercion, finite floats."""


def _one_bandwidth(data: Any, where: str) -> Any:
    """Accept ``bandwidth_gbps`` (GB/s) or ``bandwidth_gbit`` (Gb/s line rate), exactly one."""
    if not isinstance(data, dict):
        return data
    if "bandwidth_gbps" in data and "bandwidth_gbit" in data:
        raise ValueError(f"{where} gives both bandwidth_gbps and bandwidth_gbit; keep one")
    if "bandwidth_gbit" in data:
        data = dict(data)
        gbit = data.pop("bandwidth_gbit")
        data["bandwidth_gbps"] = (
            gbit / 8 if isinstance(gbit, int | float) and not isinstance(gbit, bool) else gbit
        )
    return data


class LinkSpec(BaseModel):
    """The link between devices inside a node; unset fields come from the device catalog."""

    model_config = STRICT
    kind: Literal["nvlink", "pcie"] | None = None
    bandwidth_gbps: float | None = Field(default=None, gt=0)
    latency_us: float | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _bandwidth(cls, data: Any) -> Any:
        return _one_bandwidth(data, "link")


class DeviceOverride(BaseModel):
    model_config = STRICT
    local_rank: int = Field(ge=0)
    memory_gb: float | None = Field(default=None, gt=0)
    tflops: float | None = Field(default=None, gt=0)
    price_per_hour: float | None = Field(default=None, ge=0)


class NodeSpec(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    device: str = Field(min_length=1)
    count: int = Field(gt=0, le=MAX_DEVICES)
    repeat: int = Field(default=1, gt=0, le=MAX_DEVICES)
    link: LinkSpec = LinkSpec()
    memory_gb: float | None = Field(default=None, gt=0)
    tflops: float | None = Field(default=None, gt=0)
    price_per_hour: float | None = Field(default=None, ge=0)
    devices: list[DeviceOverride] = []
    host: str | None = Field(default=None, min_length=1, pattern=_HOST)
    hosts: list[str] | None = None

    @model_validator(mode="after")
    def _hosts(self) -> NodeSpec:
        if self.host is not None and (self.hosts is not None or self.repeat > 1):
            raise ValueError("`host` names one machine: with `repeat` > 1 give `hosts`, one per copy")
        if self.hosts is not None:
            if len(self.hosts) != self.repeat:
                raise ValueError(f"`hosts` has {len(self.hosts)} entries but `repeat` is {self.repeat}; "
                                 "give one host per copy")
            bad = [h for h in self.hosts if not re.fullmatch(_HOST, h)]
            if bad:
                raise ValueError(f"`hosts` entry '{printable(bad[0])}' is not a host name or address")
        return self

    def host_of(self, copy: int) -> str | None:
        """The host of copy ``copy`` (0-based) of this node, if the file gives one."""
        return self.hosts[copy] if self.hosts is not None else self.host


class PairSpec(BaseModel):
    model_config = STRICT
    between: list[str] = Field(min_length=2, max_length=2)
    bandwidth_gbps: float = Field(gt=0)
    latency_us: float | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _bandwidth(cls, data: Any) -> Any:
        return _one_bandwidth(data, "pair")


class TierSpec(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1)
    bandwidth_gbps: float = Field(gt=0)
    latency_us: float = Field(default=DEFAULT_TIER_LATENCY_US, ge=0)
    groups: dict[str, list[str]] | None = None
    pairs: list[PairSpec] = []

    @model_validator(mode="before")
    @classmethod
    def _bandwidth(cls, data: Any) -> Any:
        return _one_bandwidth(data, "tier")


class ClusterFile(BaseModel):
    model_config = STRICT
    name: str = Field(default="cluster", min_length=1)
    catalog: str | None = None
    # Catalog entries inline (as a catalog file's [devices] table): what a plan stores of the
    # device types it was made for, so that it needs no catalog file (medley.spec.catalog).
    device_types: dict[str, dict[str, Any]] | None = Field(default=None, max_length=64)
    nodes: list[NodeSpec] = Field(min_length=1)
    tiers: list[TierSpec] = []

    @model_validator(mode="after")
    def _bounded(self) -> ClusterFile:
        total = sum(node.count * node.repeat for node in self.nodes)
        if total > MAX_DEVICES:
            raise ValueError(
                f"the nodes hold {total:,} devices; the limit is {MAX_DEVICES:,} devices per cluster: "
                "use fewer nodes, devices or repeats"
            )
        return self


def printable(text: object) -> str:
    """``text`` on one line: control characters (newlines included) written as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _fix(problem: Any, doc: str) -> str:
    """The fix for one pydantic problem, derived from the constraint that failed ("" when the
    message, one of this schema's own checks, already says it)."""
    ctx = problem.get("ctx") or {}
    kind = problem["type"]
    if kind == "value_error":
        return ""
    bounds = {"greater_than": "> {gt}", "greater_than_equal": ">= {ge}", "less_than": "< {lt}",
              "less_than_equal": "<= {le}"}
    if kind in bounds:
        return "use a number " + bounds[kind].format(**ctx)
    fixes = {
        "missing": "add this field",
        "extra_forbidden": "remove it or fix its spelling",
        "int_type": "write a whole number without quotes (e.g. 4, not 4.0, \"4\" or true)",
        "float_type": "write a number without quotes (e.g. 12.5)",
        "finite_number": "write a finite number",
        "bool_type": "write true or false without quotes",
        "string_type": "write a quoted string",
        "list_type": "write a list [ ... ]",
        "dict_type": "write a table",
        "model_type": "write a table",
        "too_short": f"give at least {ctx.get('min_length', 1)} entries",
        "too_long": f"give at most {ctx.get('max_length')} entries",
        "string_too_short": "give a non-empty name",
        "string_pattern_mismatch": "use only letters, digits, '-', '_' and '.'",
        "literal_error": "use one of the values listed",
    }
    return fixes.get(kind, f"see {doc}")


def describe_validation_error(err: ValidationError, source: str, *, doc: str = CLUSTER_DOC) -> str:
    """One line: the file, the dotted field path of the first problem, what is wrong and the fix
    (derived from the constraint; ``doc`` is where the format is described), and how many more."""
    problems = err.errors()
    problem = problems[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in problem["loc"]).lstrip(".")
    msg = problem["msg"].removeprefix("Value error, ")
    more = f" ({len(problems) - 1} more problems)" if len(problems) > 1 else ""
    fix = _fix(problem, doc)
    return printable(f"{source}: field '{loc or '<top level>'}': {msg}" + (f"; fix: {fix}" if fix else "")
                     + f".{more}")
