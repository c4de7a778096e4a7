"""The user's own measurements for a cluster: one profile per device type, none left unused.

``medley plan``, ``show`` and ``simulate`` take ``--profile FILE`` (repeated, one per device type,
files written by ``medley profile``) and ``--profiles DIR`` (Metis-format files, either layout of
:mod:`medley.cost.metis`). :func:`measured_cost_source` matches every profile to the cluster's
device types and answers each type from its own profile, every other type from the catalog:

* a profile's device type is matched by catalog name or alias (``V100`` is V100-16GB), a CUDA
  name (``NVIDIA A100-SXM4-80GB``, as older profile files wrote it) or, for a bare GPU name as
  Metis writes it (``A100``), the one type of the cluster whose name starts with it
  (A100-80GB); per-node variants of a type (``A100-80GB@node``) count as that type;
* a ``--profile`` file that matches no type of the cluster, a GPU name that could be several of
  its types, two profiles of one type, or a ``medley profile`` file of another model is a
  :class:`MedleyInputError` naming the file; a ``--profiles`` directory may hold types the
  cluster lacks (the public profile sets hold seven): those are left out and named in a note
  (``notes``), so nothing is ignored silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import CostSource, Pass, TimeEstimate
from medley.cost.profile_format import load_profile
from medley.cost.profiles import ProfileCostSource
from medley.errors import MedleyInputError
from medley.spec.catalog import device_type_for_cuda, get_device_type
from medley.spec.cluster import Cluster
from medley.spec.cluster_schema import printable


@dataclass(kw_only=True)
class PerDeviceCostSource:
    """A :class:`CostSource` that asks every question, for each device type, of the measured
    source given for it, and of ``fallback`` for every other type.

    Attributes:
        sources: cluster device type name -> the measured source answering for it.
        fallback: answers the types without a profile (the catalog estimate).
        profile_dtype: the dtype every ``medley profile`` file was measured in, when they agree
            (``simulate`` defaults to it); None otherwise.
    """

    sources: dict[str, CostSource]
    fallback: CostSource
    profile_dtype: str | None = None

    def source_for(self, device_type: str) -> CostSource:
        return self.sources.get(device_type, self.fallback)

    def layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate:
        return self.source_for(device_type).layer_time(
            layer, kind, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )

    def activation_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> tuple[float, float] | None:
        return self.source_for(device_type).activation_bytes(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type)

    def backward_full_time(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate | None:
        return self.source_for(device_type).backward_full_time(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type)

    def workspace_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        return self.source_for(device_type).workspace_bytes(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type)

    def fsdp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        return self.source_for(device_type).fsdp_extra_time(
            layer, kind, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type)

    def optimizer_time(self, params: float, *, device_type: str) -> TimeEstimate | None:
        return self.source_for(device_type).optimizer_time(params, device_type=device_type)

    def tp_layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int
    ) -> TimeEstimate | None:
        return self.source_for(device_type).tp_layer_time(
            layer, kind, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type, tp=tp)

    def tp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        return self.source_for(device_type).tp_extra_time(
            layer, kind, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type)

    def action_overhead_time(self, *, device_type: str) -> float | None:
        return self.source_for(device_type).action_overhead_time(device_type=device_type)

    def p2p_overhead_time(self) -> float | None:
        """The runtime's hand-off, not a device's: the largest any measured source gives."""
        return _largest(source.p2p_overhead_time() for source in self.sources.values())

    def collective_overhead_time(self) -> float | None:
        """The runtime's work around a collective call: the largest any measured source gives."""
        return _largest(source.collective_overhead_time() for source in self.sources.values())


def _largest(answers: Iterable[float | None]) -> float | None:
    known = [value for value in answers if value is not None]
    return max(known) if known else None


def _base(name: str) -> str:
    """The catalog type of a cluster type name (``A100-80GB@node3`` -> ``A100-80GB``)."""
    return name.split("@", 1)[0]


def _catalog_name(label: str) -> str:
    for lookup in (get_device_type, device_type_for_cuda):
        try:
            return lookup(label).name
        except MedleyInputError:
            continue
    return label


def cluster_types_for(
    label: str, cluster: Cluster, *, flag: str, catalog_name: str | None = None, bare: bool = False,
    missing_ok: bool = False,
) -> list[str]:
    """The names of ``cluster``'s device types that a profile of ``label`` (the catalog's
    ``catalog_name`` when known) stands for (module docstring; ``bare``: ``label`` is a GPU name
    as Metis writes it, which may also stand for the one type whose name starts with it); none,
    or several different types, is a :class:`MedleyInputError` naming ``flag`` (none is ``[]``
    with ``missing_ok``)."""
    names = list(cluster.device_types())
    canonical = catalog_name or _catalog_name(label)
    exact = [n for n in names if _base(n) == canonical]
    if exact:
        return exact
    start = label.strip().upper() + "-"
    prefix = [n for n in names if bare and _base(n).upper().startswith(start)]
    bases = sorted({_base(n) for n in prefix})
    if len(bases) == 1:
        return prefix
    types = ", ".join(sorted({_base(n) for n in names}))
    if bases:
        raise MedleyInputError(
            f"{flag}: GPU name '{printable(label)}' could be any of {', '.join(bases)} in cluster "
            f"'{printable(cluster.name)}'; name the profile after one of them (e.g. "
            f"DeviceType.{bases[0]}_tp1_bs1.json)."
        )
    if missing_ok:
        return []
    raise MedleyInputError(
        f"{flag}: measured device type '{printable(label)}', which cluster '{printable(cluster.name)}' "
        f"does not have (its types: {types}); give profiles of those types only (`medley profile "
        "--device-type NAME` labels a profile)."
    )


def _claim(owners: dict[str, str], names: Sequence[str], flag: str) -> None:
    """Record that ``flag`` answers for ``names``; a type claimed twice is an error."""
    for name in names:
        if name in owners:
            raise MedleyInputError(
                f"{flag}: a second profile of device type '{printable(_base(name))}' ({owners[name]} has it "
                "too); give one profile per device type."
            )
        owners[name] = flag


def _profile_source(
    path: Path, model_name: str, cost: CatalogCostSource, cluster: Cluster, owners: dict[str, str]
) -> ProfileCostSource:
    flag = f"--profile {path}"
    profile = load_profile(path)
    names = cluster_types_for(profile.device_type, cluster, flag=flag)
    _claim(owners, names, flag)
    source = ProfileCostSource(profile=profile, name=Path(path).name, model=cost.model, fallback=cost,
                               device_scale=dict.fromkeys(names, 1.0))
    if not source.matches_model:
        raise MedleyInputError(
            f"{flag}: measured model '{printable(str(profile.model.get('name')))}', not '{model_name}' (or "
            f"another shape of it); profile this model with `medley profile --model {model_name}`."
        )
    return source


def _metis_source(
    directory: Path, cost: CatalogCostSource, cluster: Cluster, owners: dict[str, str], seq_len: int | None,
    notes: list[str],
) -> tuple[CostSource, list[str]]:
    from medley.cost.metis import MetisCostSource

    source = MetisCostSource.from_directory(directory, cost.model, fallback=cost, assumed_seq_len=seq_len)
    entries, left_out = {}, []
    for name, by_mbs in source.profile.entries.items():
        gpu = source.profile.gpu_names.get(name, name)
        flag = f"--profiles {directory} ({gpu})"
        names = cluster_types_for(gpu, cluster, flag=flag, catalog_name=name, bare=True, missing_ok=True)
        if not names:
            left_out.append(printable(gpu))
        _claim(owners, names, flag)
        entries.update(dict.fromkeys(names, by_mbs))
    if not entries:
        types = ", ".join(sorted({_base(n) for n in cluster.device_types()}))
        raise MedleyInputError(
            f"--profiles {directory}: no profile of a type cluster '{printable(cluster.name)}' has (its "
            f"types: {types}; the directory's: {', '.join(sorted(left_out))}); give a directory with "
            "profiles of those types.")
    if left_out:
        notes.append(f"--profiles {directory}: left out the profiles of {', '.join(sorted(left_out))}, "
                     "types the cluster does not have")
    source.profile = dataclasses.replace(source.profile, entries=entries)
    return source, list(entries)


def measured_cost_source(
    cost: CatalogCostSource, cluster: Cluster, *, profiles: Sequence[Path] = (),
    profiles_dir: Path | None = None, seq_len: int | None = None, notes: list[str] | None = None,
) -> CostSource:
    """``cost`` (the catalog estimate) with each device type that ``profiles`` or ``profiles_dir``
    measured answered from its profile. ``seq_len`` is assumed for Metis files that do not
    record theirs. ``notes`` gets one line per thing left out (profiles of types the cluster
    lacks in ``profiles_dir``)."""
    if not profiles and profiles_dir is None:
        return cost
    owners: dict[str, str] = {}
    sources: dict[str, CostSource] = {}
    dtypes = set()
    for path in profiles:
        source = _profile_source(Path(path), cost.model.name, cost, cluster, owners)
        sources.update(dict.fromkeys(source.device_scale, source))
        dtypes.add(source.profile.dtype)
    if profiles_dir is not None:
        metis, names = _metis_source(Path(profiles_dir), cost, cluster, owners, seq_len,
                                     notes if notes is not None else [])
        sources.update(dict.fromkeys(names, metis))
    return PerDeviceCostSource(sources=sources, fallback=cost,
                               profile_dtype=dtypes.pop() if len(dtypes) == 1 else None)
