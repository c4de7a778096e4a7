"""The accelerator catalog: peak compute, memory and links per device type.

The built-in data lives in ``devices.toml`` next to this file (sources in its header and in
docs/cost-model.md). Users add or override entries with a TOML file of the same shape: an entry
whose name (or alias) already exists updates only the fields it gives; a new name must give them all.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from medley.errors import MedleyInputError
from medley.fileio import read_toml
from medley.spec.cluster_schema import STRICT, describe_validation_error, printable

BUILTIN_CATALOG = Path(__file__).with_name("devices.toml")
CPU_DEVICE_TYPE = "CPU-8GB"  # the catalog's generic CPU core (medley runs one rank per core)
Confidence = Literal["high", "medium", "low"]
DEFAULT_MATMUL_EFFICIENCY = 0.75  # large bf16 GEMMs in cuBLAS reach ~75-90% of dense peak; the low end
DEFAULT_MEMORY_EFFICIENCY = 0.8  # achievable fraction of the memory bandwidth for streaming kernels
DEFAULT_KERNEL_OVERHEAD_US = 5.0  # a kernel with its eager-mode launch takes at least this long


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceType:
    """One accelerator model.

    Attributes:
        name: canonical name, ``<MODEL>-<MEMORY>GB``.
        peak_tflops_half: dense bf16 tensor TFLOPS (fp16 where the device has no bf16).
        peak_tflops_fp32: non-tensor fp32 TFLOPS.
        memory_gb: device memory in GB (10^9 bytes).
        memory_bandwidth_gbps: device memory bandwidth, GB/s.
        intra_node_link: ``nvlink`` (a switched GPU-to-GPU fabric) or ``pcie``.
        intra_node_bandwidth_gbps: per device, per direction, GB/s.
        supports_bf16: False for V100/T4-class parts (plans mixing them must run fp16).
        confidence: ``high`` (datasheet), ``medium`` or ``low`` (unofficial: override when measured).
        intra_node_fabric: the fabric's vendor name (NVLink3, xGMI, ...), for display.
        aliases: other accepted names.
        cuda_names: what ``torch.cuda.get_device_name()`` reports for this part.
        matmul_efficiency: fraction of dense peak a large matmul reaches (the roofline's ceiling,
            :mod:`medley.cost.estimator`); calibrated per type where published runs allow
            (``calibration`` names them), else :data:`DEFAULT_MATMUL_EFFICIENCY`.
        attention_efficiency: the same for the attention kernel's matmuls (flash attention).
        memory_efficiency: fraction of the memory bandwidth streaming (elementwise) kernels reach.
        kernel_overhead_us: the least time one kernel takes with its eager-mode launch, µs.
        calibration: where the four figures above come from (empty: the defaults).
    """

    name: str
    peak_tflops_half: float
    peak_tflops_fp32: float
    memory_gb: float
    memory_bandwidth_gbps: float
    intra_node_link: str
    intra_node_bandwidth_gbps: float
    supports_bf16: bool
    confidence: str
    intra_node_fabric: str = ""
    aliases: tuple[str, ...] = ()
    cuda_names: tuple[str, ...] = ()
    matmul_efficiency: float = DEFAULT_MATMUL_EFFICIENCY
    attention_efficiency: float = DEFAULT_MATMUL_EFFICIENCY
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    kernel_overhead_us: float = DEFAULT_KERNEL_OVERHEAD_US
    calibration: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (bf16, fp16 or fp32)."""
        return (self.peak_tflops_fp32 if dtype == "fp32" else self.peak_tflops_half) * 1e12


def half_precision(types: Iterable[DeviceType]) -> str:
    """The precision a plan on devices of ``types`` trains in unless told otherwise: bf16 when
    every type has it, else fp16 (with loss scaling: V100- and T4-class parts have no bf16)."""
    return "bf16" if all(t.supports_bf16 for t in types) else "fp16"


def lacking_bf16(types: Iterable[DeviceType]) -> list[str]:
    """The names of the types among ``types`` that have no bf16, sorted."""
    return sorted({t.name for t in types if not t.supports_bf16})


def _have(names: list[str]) -> str:
    return f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no bf16"


def check_precision(dtype: str, types: Iterable[DeviceType], *, where: str, fix: str) -> None:
    """Refuse ``dtype`` bf16 on devices of ``types`` when any lacks it: one line, ``where`` (the
    file and field, or the flag) first, the types that lack it, then ``fix``. Every plan that is
    made, loaded or simulated passes here: plan files, the inline plan of ``simulate`` and
    ``train``, ``medley plan --dtype`` (:mod:`medley.search.planner`) and a CUDA run's ``--dtype``
    (:func:`medley.cli.preflight.preflight`)."""
    lacking = lacking_bf16(types) if dtype == "bf16" else []
    if lacking:
        raise MedleyInputError(f"{where}: {_have(lacking)}; {fix}")


def precision_reason(dtype: str, types: Iterable[DeviceType]) -> str:
    """Why a plan on devices of ``types`` trains in ``dtype``, in words (plan table, show, explain,
    simulate); it looks at the types, so bf16 on a type without it says so."""
    lacking = lacking_bf16(types)
    if dtype == "fp16" and lacking:
        return f"fp16 with loss scaling: {_have(lacking)}"
    if dtype == "bf16":
        if lacking:  # refused where plans are loaded (check_precision); said plainly if one gets here
            return f"bf16, but {_have(lacking)}: use fp16, or devices that have bf16"
        return "bf16: every device of the plan has it"
    return f"{dtype}: as set (plan --dtype or the plan file)"


class _Entry(BaseModel):
    """One catalog entry as written in TOML; every field optional so partial overrides validate."""

    model_config = STRICT

    aliases: list[str] | None = None
    cuda_names: list[str] | None = None
    peak_tflops_half: float | None = Field(default=None, gt=0)
    peak_tflops_fp32: float | None = Field(default=None, gt=0)
    memory_gb: float | None = Field(default=None, gt=0)
    memory_bandwidth_gbps: float | None = Field(default=None, gt=0)
    intra_node_link: Literal["nvlink", "pcie"] | None = None
    intra_node_fabric: str | None = None
    intra_node_bandwidth_gbps: float | None = Field(default=None, gt=0)
    supports_bf16: bool | None = None
    confidence: Confidence | None = None
    matmul_efficiency: float | None = Field(default=None, gt=0, le=1)
    attention_efficiency: float | None = Field(default=None, gt=0, le=1)
    memory_efficiency: float | None = Field(default=None, gt=0, le=1)
    kernel_overhead_us: float | None = Field(default=None, ge=0, le=1e4)
    calibration: str | None = None


class _CatalogFile(BaseModel):
    model_config = STRICT

    devices: dict[str, _Entry]


_OPTIONAL = ("name", "intra_node_fabric", "aliases", "cuda_names", "matmul_efficiency",
             "attention_efficiency", "memory_efficiency", "kernel_overhead_us", "calibration")
_REQUIRED = [f.name for f in fields(DeviceType) if f.name not in _OPTIONAL]


def _read_catalog_file(path: Path) -> _CatalogFile:
    raw = read_toml(path, what="device catalog")
    try:
        return _CatalogFile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, str(path))) from None


def _merge(catalog: dict[str, DeviceType], path: Path, data: _CatalogFile) -> None:
    for name, entry in data.devices.items():
        given = entry.model_dump(exclude_none=True)
        for key in ("aliases", "cuda_names"):
            if key in given:
                given[key] = tuple(given[key])
        key = _index(catalog).get(name.upper())
        if key is not None:
            catalog[key] = replace(catalog[key], **given)
            continue
        missing = [f for f in _REQUIRED if f not in given]
        if missing:
            raise MedleyInputError(
                f"{path}: field 'devices.{printable(name)}': new device type is missing "
                f"{', '.join(missing)}; give them, or use an existing name to override only some fields."
            )
        catalog[name] = DeviceType(name=name, **given)


def _index(catalog: dict[str, DeviceType]) -> dict[str, str]:
    """Upper-cased name and alias -> canonical name."""
    index: dict[str, str] = {}
    for name, device in catalog.items():
        for key in (name, *device.aliases):
            index.setdefault(key.upper(), name)
    return index


@functools.cache
def _builtin() -> tuple[DeviceType, ...]:
    catalog: dict[str, DeviceType] = {}
    _merge(catalog, BUILTIN_CATALOG, _read_catalog_file(BUILTIN_CATALOG))
    return tuple(catalog.values())


def with_entries(catalog: dict[str, DeviceType], entries: dict[str, object], *,
                 source: str) -> dict[str, DeviceType]:
    """A copy of ``catalog`` with ``entries`` (a catalog file's ``[devices]`` table, as a cluster
    file's or plan's ``device_types``) added or overriding, validated as a catalog file is."""
    try:
        data = _CatalogFile.model_validate({"devices": entries})
    except ValidationError as err:
        message = describe_validation_error(err, source).replace("'devices.", "'device_types.")
        raise MedleyInputError(message) from None
    merged = dict(catalog)
    _merge(merged, Path(source), data)
    return merged


def catalog_entry(device: DeviceType) -> dict[str, object]:
    """``device`` as a whole catalog entry (every field: it needs no catalog to be read back)."""
    entry = {f.name: getattr(device, f.name) for f in fields(DeviceType) if f.name != "name"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in entry.items() if v not in ("", ())}


def load_catalog(extra: Path | None = None) -> dict[str, DeviceType]:
    """The built-in catalog, with entries from ``extra`` added or overriding (name -> type)."""
    catalog = {device.name: device for device in _builtin()}
    if extra is not None:
        _merge(catalog, extra, _read_catalog_file(extra))
    return catalog


def get_device_type(name: str, catalog: dict[str, DeviceType] | None = None) -> DeviceType:
    """Look a device type up by name or alias, case-insensitively; unknown names suggest close ones."""
    catalog = load_catalog() if catalog is None else catalog
    index = _index(catalog)
    key = index.get(name.strip().upper())
    if key is not None:
        return catalog[key]
    close = difflib.get_close_matches(name.strip().upper(), list(index), n=3, cutoff=0.5)
    hint = ", ".join(dict.fromkeys(index[c] for c in close)) if close else ", ".join(sorted(catalog))
    raise MedleyInputError(
        f"unknown device type '{printable(name)}'. Did you mean: {hint}? (`medley devices` lists the "
        f"catalog; add new types with a catalog file.)"
    )


# A GPU's reported memory (MiB-based, minus what the driver reserves) may differ from the catalog's
# marketing GB by this fraction and still be that part: A100-80GB reports 85.1e9, T4 15.8e9 bytes.
CUDA_MEMORY_TOLERANCE = 0.15


def device_type_for_cuda(name: str, catalog: dict[str, DeviceType] | None = None) -> DeviceType:
    """The catalog entry whose ``cuda_names`` (or name or alias) is ``name``, as
    ``torch.cuda.get_device_name()`` reports it; an unknown GPU names the closest entries and the
    fix (``--device-type``, or a catalog file with ``cuda_names``)."""
    catalog = load_catalog() if catalog is None else catalog
    wanted = name.strip().upper()
    for device in catalog.values():
        if wanted in {n.upper() for n in (*device.cuda_names, device.name, *device.aliases)}:
            return device
    keys = {n.upper(): d.name for d in catalog.values() for n in (*d.cuda_names, d.name, *d.aliases)}
    close = difflib.get_close_matches(wanted, list(keys), n=3, cutoff=0.4)
    hint = ", ".join(dict.fromkeys(keys[c] for c in close)) or "none"
    raise MedleyInputError(
        f"GPU '{printable(name)}' is not in the device catalog (closest entries: {hint}); name its type "
        "with --device-type, or add it with cuda_names to a catalog file")


def cuda_mismatch(device: DeviceType, name: str, total_memory_bytes: int) -> str | None:
    """Why a GPU reporting ``name`` and ``total_memory_bytes`` is not ``device`` (None if it is).
    A type without ``cuda_names`` matches any name; memory must agree within
    :data:`CUDA_MEMORY_TOLERANCE`."""
    names = {n.upper() for n in (*device.cuda_names, device.name, *device.aliases)}
    if device.cuda_names and name.strip().upper() not in names:
        return f"'{printable(name)}' is not a {device.name} ({', '.join(device.cuda_names)})"
    if abs(total_memory_bytes - device.memory_bytes) > CUDA_MEMORY_TOLERANCE * device.memory_bytes:
        return (f"it has {total_memory_bytes / 1e9:.1f} GB of memory, a {device.name} has "
                f"{device.memory_gb:g} GB")
    return None
