"""The cluster TOML schema (pydantic) and its error messages. docs/cluster-format.md describes it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_TIER_LATENCY_US = 25.0
_STRICT = ConfigDict(extra="forbid", strict=False)


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

    model_config = _STRICT
    kind: Literal["nvlink", "pcie"] | None = None
    bandwidth_gbps: float | None = Field(default=None, gt=0)
    latency_us: float | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _bandwidth(cls, data: Any) -> Any:
        return _one_bandwidth(data, "link")


class DeviceOverride(BaseModel):
    model_config = _STRICT
    local_rank: int = Field(ge=0)
    memory_gb: float | None = Field(default=None, gt=0)
    tflops: float | None = Field(default=None, gt=0)
    price_per_hour: float | None = Field(default=None, ge=0)


class NodeSpec(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    device: str = Field(min_length=1)
    count: int = Field(gt=0)
    repeat: int = Field(default=1, gt=0)
    link: LinkSpec = LinkSpec()
    memory_gb: float | None = Field(default=None, gt=0)
    tflops: float | None = Field(default=None, gt=0)
    price_per_hour: float | None = Field(default=None, ge=0)
    devices: list[DeviceOverride] = []


class PairSpec(BaseModel):
    model_config = _STRICT
    between: tuple[str, str]
    bandwidth_gbps: float = Field(gt=0)
    latency_us: float | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _bandwidth(cls, data: Any) -> Any:
        return _one_bandwidth(data, "pair")


class TierSpec(BaseModel):
    model_config = _STRICT
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
    model_config = _STRICT
    name: str = Field(default="cluster", min_length=1)
    catalog: str | None = None
    nodes: list[NodeSpec] = Field(min_length=1)
    tiers: list[TierSpec] = []


_FIXES = {
    "missing": "add this field",
    "extra_forbidden": "remove it or fix its spelling",
    "greater_than": "use a positive number",
    "greater_than_equal": "use a number >= 0",
    "too_short": "give at least one entry (a non-empty value)",
    "string_too_short": "give a non-empty name",
    "string_pattern_mismatch": "use only letters, digits, '-', '_' and '.'",
    "literal_error": "use one of the values listed",
}


def describe_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem (at most three): file, dotted field path, what is wrong, the fix."""
    lines = []
    for problem in err.errors()[:3]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in problem["loc"]).lstrip(".")
        fix = _FIXES.get(problem["type"], "see docs/cluster-format.md")
        msg = problem["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: field '{loc or '<top level>'}': {msg}; fix: {fix}.")
    extra = len(err.errors()) - len(lines)
    return "\n".join(lines) + (f"\n(and {extra} more)" if extra > 0 else "")
