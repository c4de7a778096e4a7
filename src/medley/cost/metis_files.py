"""The Metis planner's profile files: where they lie, what they hold, read and checked.

Two layouts on disk, both for one model (or one subdirectory per model, ``DIR/<MODEL>/...``,
then the model is picked by name):

* Metis's own (github.com/SamsungLabs/Metis, ``profile_data_samples/``): flat files
  ``DIR/DeviceType.{GPU}_tp{T}_bs{B}.json``, GPU as Metis names it (``A100``, ``V100``, ``T4``);
* the repackaged one of the public Sailor data: ``DIR/<GPU>/mbs{B}_tmp{T}.json`` (``A100-40``).

Each file holds, for one GPU type, micro-batch size B and tensor-parallel degree T: per-layer
parameter bytes, per-layer forward+backward milliseconds, the whole forward+backward and
optimizer times, and per-layer memory. A GPU name is matched to the catalog by name or alias
(``A100`` is A100-40GB, ``A100-80`` is A100-80GB). How the numbers are used:
:mod:`medley.cost.metis`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from medley.errors import MedleyInputError
from medley.fileio import read_user_json
from medley.spec.catalog import get_device_type
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec

# Metis / Sailor GPU directory names -> medley catalog names. Names not listed keep their own
# name (add them to a catalog file, or use them as aliases, to plan with them).
DEVICE_NAMES = {
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "V100-16": "V100-16GB",
    "V100-32": "V100-32GB",
    "RTX-3090": "RTX3090-24GB",
    "RTX-4090": "RTX4090-24GB",
    "H100-80": "H100-SXM-80GB",
    "T4-16": "T4-16GB",
}
MODEL_NAMES = {"OPT-350": "opt-350m", "GPT-NEO-2.7": "gpt-neo-2.7b", "LLAMA-3-8": "llama-3-8b"}
PROFILE_ACTIVATION_BYTES = 4  # the public profiles were measured in fp32


@dataclass(frozen=True, kw_only=True, slots=True)
class MetisEntry:
    """One profile file: a GPU type at one micro-batch size and tensor-parallel degree.

    ``boundary_bytes`` is empty when the file does not record them (Metis's own samples);
    ``label`` names the file in answers' sources (``metis:A100-40/mbs1_tmp1.json``)."""

    path: Path
    label: str
    micro_batch_size: int
    tp: int
    layer_ms: tuple[float, ...]
    param_bytes: tuple[float, ...]
    boundary_bytes: tuple[float, ...]
    layer_memory_mb: tuple[float, ...]
    forward_backward_ms: float
    optimizer_ms: float


_NEEDS = ("it needs model.parameters.parameters_per_layer_bytes, execution_time.layer_compute_total_ms, "
          "execution_time.optimizer_time_ms and execution_memory.layer_memory_total_mb")


def _field(raw: object, where: str, path: Path) -> object:
    """``raw`` followed down the dotted ``where`` (objects only), or a one-line error naming it."""
    value = raw
    for key in where.split("."):
        if not isinstance(value, dict) or key not in value:
            raise MedleyInputError(f"{path}: field '{where}' is missing; not a Metis-format profile "
                                   f"({_NEEDS}).")
        value = value[key]
    return value


def _number(value: object, where: str, path: Path, *, positive: bool) -> float:
    """A JSON number, finite and > 0 (times, boundary bytes) or >= 0 (sizes): no strings, no
    booleans (``float("0.94")`` and ``float(True)`` once passed), no NaN or Infinity."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and (
        value > 0 if positive else value >= 0)
    if not ok:
        want = "a number > 0" if positive else "a number >= 0"
        raise MedleyInputError(f"{path}: field '{where}' must be {want} (finite, not a string), got "
                               f"{printable(repr(value))[:60]}; fix the file or measure it again.")
    return float(value)


def _numbers(raw: object, where: str, path: Path, *, positive: bool, optional: bool = False
             ) -> tuple[float, ...]:
    values = [] if optional and _absent(raw, where) else _field(raw, where, path)
    if not isinstance(values, list):
        raise MedleyInputError(f"{path}: field '{where}' must be a list of numbers, got "
                               f"{type(values).__name__}; fix the file or measure it again.")
    return tuple(_number(x, f"{where}[{i}]", path, positive=positive) for i, x in enumerate(values))


def _absent(raw: object, where: str) -> bool:
    head, _, last = where.rpartition(".")
    parent = raw
    for key in head.split("."):
        parent = parent.get(key) if isinstance(parent, dict) else None
    return not isinstance(parent, dict) or last not in parent


def _read_entry(path: Path, micro_batch_size: int, label: str, tp: int = 1) -> MetisEntry:
    raw = read_user_json(path, what="profile", fix=f"give a Metis-format profile ({_NEEDS})")
    if not isinstance(raw, dict):
        raise MedleyInputError(f"{path}: not a Metis-format profile (a JSON object); {_NEEDS}.")
    layer_ms = _numbers(raw, "execution_time.layer_compute_total_ms", path, positive=True)
    whole = "execution_time.forward_backward_time_ms"
    return MetisEntry(
        path=path,
        label=label,
        micro_batch_size=micro_batch_size,
        tp=tp,
        layer_ms=layer_ms,
        param_bytes=_numbers(raw, "model.parameters.parameters_per_layer_bytes", path, positive=False),
        boundary_bytes=_numbers(raw, "model.parameters.activation_parameters_bytes", path, positive=True,
                                optional=True),
        layer_memory_mb=_numbers(raw, "execution_memory.layer_memory_total_mb", path, positive=False),
        forward_backward_ms=sum(layer_ms) if _absent(raw, whole) else _number(
            _field(raw, whole, path), whole, path, positive=True),
        optimizer_ms=_number(_field(raw, "execution_time.optimizer_time_ms", path),
                             "execution_time.optimizer_time_ms", path, positive=True),
    )


def catalog_device_name(gpu_dir: str) -> str:
    """The catalog name of a profile's GPU directory (``A100-40`` -> ``A100-40GB``)."""
    name = DEVICE_NAMES.get(gpu_dir.upper(), DEVICE_NAMES.get(gpu_dir, gpu_dir))
    try:
        return get_device_type(name).name
    except MedleyInputError:
        return name


@dataclass(kw_only=True)
class MetisProfile:
    """The files of one model under a directory: ``entries`` (tmp1) by catalog device name and
    micro-batch size, ``tp_entries`` (tmp2 and up) by catalog device name, degree and size.

    ``gpu_names``: catalog device name -> the GPU name the files use (``A100``, ``V100-16``)."""

    directory: Path
    entries: dict[str, dict[int, MetisEntry]]
    num_layers: int
    seq_len: int
    gpu_names: dict[str, str] = field(default_factory=dict)
    tp_entries: dict[str, dict[int, dict[int, MetisEntry]]] = field(default_factory=dict)

    def micro_batch_sizes(self, device_type: str) -> tuple[int, ...]:
        return tuple(sorted(self.entries.get(device_type, {})))

    def layer_memory_bytes(self, device_type: str, micro_batch_size: int) -> tuple[float, ...]:
        entry = self.entries[device_type][micro_batch_size]
        return tuple(mb * 2**20 for mb in entry.layer_memory_mb)

    def optimizer_s(self, device_type: str, micro_batch_size: int) -> float:
        return self.entries[device_type][micro_batch_size].optimizer_ms / 1e3


# Metis's own file names: DeviceType.{GPU}_tp{T}_bs{B}.json; the repackaged ones: GPU/mbs{B}_tmp{T}.json
METIS_FILE = re.compile(r"^DeviceType\.(?P<gpu>.+)_tp(?P<tp>[0-9]+)_bs(?P<bs>[0-9]+)\.json$")
REPACKAGED_FILE = re.compile(r"^mbs(?P<bs>[0-9]+)_tmp(?P<tp>[0-9]+)\.json$")


def profile_files(directory: Path, *, tp: bool = False) -> list[tuple[str, int, Path, str, int]]:
    """(GPU name, micro-batch size, path, label, TP degree) of every tensor-parallel-1 file (with
    ``tp``: every file of a degree above 1) directly in ``directory`` (Metis's layout) or one
    level down (the repackaged layout)."""
    found = []
    for path in sorted(directory.glob("DeviceType.*.json")):
        match = METIS_FILE.match(path.name)
        if match and (int(match["tp"]) > 1) == tp:
            found.append((match["gpu"], int(match["bs"]), path, path.name, int(match["tp"])))
    for path in sorted(directory.glob("*/mbs*_tmp*.json")):
        match = REPACKAGED_FILE.match(path.name)
        if match and (int(match["tp"]) > 1) == tp:
            label = f"{path.parent.name}/{path.name}"
            found.append((path.parent.name, int(match["bs"]), path, label, int(match["tp"])))
    return found


def _model_directory(directory: Path, model: ModelSpec) -> Path:
    """``directory`` itself, or its subdirectory named for ``model`` (``OPT-350`` for opt-350m)."""
    if profile_files(directory):
        return directory
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
        if MODEL_NAMES.get(sub.name.upper()) == model.name or sub.name.lower() == model.name:
            return sub
    raise MedleyInputError(
        f"--profiles {directory}: no DeviceType.GPU_tp1_bsN.json (Metis) nor GPU/mbsN_tmp1.json files there "
        f"nor in a subdirectory for model '{model.name}' (known names: {', '.join(MODEL_NAMES)}); point "
        "--profiles at the model's directory."
    )


def _read_entries(root: Path) -> tuple[dict[str, dict[int, MetisEntry]], dict[str, str]]:
    entries: dict[str, dict[int, MetisEntry]] = {}
    gpu_names: dict[str, str] = {}
    for gpu, mbs, path, label, _ in profile_files(root):
        name = catalog_device_name(gpu)
        if gpu_names.setdefault(name, gpu) != gpu:
            raise MedleyInputError(
                f"--profiles {root}: GPU names '{gpu_names[name]}' and '{gpu}' both stand for {name}; keep "
                "the files of one of them."
            )
        if mbs in entries.get(name, {}):
            raise MedleyInputError(
                f"--profiles {root}: two files for {gpu} at micro-batch size {mbs} "
                f"({entries[name][mbs].label}, {label}); keep one."
            )
        entries.setdefault(name, {})[mbs] = _read_entry(path, mbs, label)
    if not entries:
        raise MedleyInputError(f"--profiles {root}: no tensor-parallel-1 files (DeviceType.GPU_tp1_bsN.json "
                               "or GPU/mbsN_tmp1.json).")
    return entries, gpu_names


def load_metis_profile(
    directory: Path, model: ModelSpec, *, seq_len: int | None = None, assumed_seq_len: int | None = None
) -> MetisProfile:
    """Read every tensor-parallel-1 file for ``model`` and check it against the model's layers.
    The sequence length is ``seq_len``, else inferred from the files' boundary bytes, else
    ``assumed_seq_len`` (for files that do not record them)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MedleyInputError(
            f"--profiles {directory}: not a directory; give a Metis-format profile directory."
        )
    root = _model_directory(directory, model)
    entries, gpu_names = _read_entries(root)
    inferred = set()
    for by_mbs in entries.values():
        for entry in by_mbs.values():
            _check_layers(entry, model)
            if len(entry.boundary_bytes) > 1:
                per_token = entry.micro_batch_size * model.hidden_size * PROFILE_ACTIVATION_BYTES
                inferred.add(round(entry.boundary_bytes[1] / per_token))
    if seq_len is None:
        if len(inferred) > 1:
            raise MedleyInputError(
                f"--profiles {root}: files disagree on the sequence length ({sorted(inferred)}); "
                "give the measured length explicitly."
            )
        seq_len = inferred.pop() if inferred else assumed_seq_len
        if seq_len is None:
            raise MedleyInputError(f"--profiles {root}: the files do not record the sequence length "
                                   "(no activation_parameters_bytes); give it with --seq-len.")
    return MetisProfile(directory=root, entries=entries, num_layers=model.num_layers, seq_len=seq_len,
                        gpu_names=gpu_names, tp_entries=_read_tp_entries(root, model, gpu_names))


def _read_tp_entries(
    root: Path, model: ModelSpec, gpu_names: dict[str, str]
) -> dict[str, dict[int, dict[int, MetisEntry]]]:
    """The files of TP degree 2 and up whose GPU the tmp1 files name too (others are skipped:
    without a tmp1 file the type is not planned from this directory) and whose layers are the
    model's."""
    found: dict[str, dict[int, dict[int, MetisEntry]]] = {}
    for gpu, mbs, path, label, tp in profile_files(root, tp=True):
        name = catalog_device_name(gpu)
        if gpu_names.get(name) != gpu:
            continue
        entry = _read_entry(path, mbs, label, tp=tp)
        _check_layers(entry, model)
        found.setdefault(name, {}).setdefault(tp, {})[mbs] = entry
    return found


def _check_layers(entry: MetisEntry, model: ModelSpec) -> None:
    """A file of another model (another layer count) is refused, naming it."""
    if len(entry.layer_ms) != model.num_layers:
        raise MedleyInputError(
            f"{entry.path}: {len(entry.layer_ms)} profiled layers but {model.name} has "
            f"{model.num_layers} (embedding, {model.num_blocks} blocks, head); use the profile "
            "of this model."
        )
