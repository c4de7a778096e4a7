"""What a checkpoint step may hold, checked before any tensor of it is read.

A step directory is untrusted input (it may come from another machine or person): loading it
must never run code, read outside it or load something medley did not write. medley writes only
tensors, so:

* ``.metadata`` (DCP's pickle) is read by an unpickler that accepts an exact list of (module,
  name) pairs (:data:`SAFE_GLOBALS`), and :class:`SafeReader` refuses any entry that is not a
  tensor (DCP loads a bytes entry with ``torch.load(weights_only=False)``, which runs code), any
  storage location that is not a DCP data file of the step directory itself, and stream
  transforms; :class:`TensorsOnlyPlanner` refuses bytes a second time, where DCP would read them;
* ``medley.json`` lists every entry (key, kind, dtype, global shape: :func:`manifest_of`) and
  every file with its sha256: the ``.metadata`` must hold exactly those entries, every location
  must lie in a listed file, and resume and export compare the entries with the model (and
  optimizer) they load into, refusing any key, kind, dtype or shape that differs.

The sha256 per file detects damage (a truncated copy, a flipped bit, a file of another step); it
does not protect against a person who can write the directory, who can rewrite ``medley.json``
too. What such a person can still do is give other weights of the same shapes; not run code,
not make medley read or write outside the step directory, not load a model of other shapes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import stat
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from medley.errors import MedleyInputError
from medley.runtime.checkpoint_layout import META_FILE
from medley.spec.cluster_schema import printable

METADATA_FILE = ".metadata"
# 3: medley.json lists every entry (key, kind, dtype, shape); 2: a sha256 per file only.
FORMAT = 3
_HASH_CHUNK = 1 << 20
_DATA_FILE = re.compile(r"__\d{1,6}_\d{1,6}\.distcp")  # what DCP's FileSystemWriter names its files
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")
_SHA256 = re.compile(r"[0-9a-f]{64}")

# The exact globals a DCP ``.metadata`` pickle names (listed from checkpoints torch 2.13 writes, by
# pickletools): its dataclasses, torch.Size, dtypes, the layout lookup and the checkpoint's path.
# Pairs, never module prefixes: pickle protocol 4 resolves dotted names, so a prefix rule lets
# ("torch.distributed.checkpoint.filesystem", "os.system") through.
_DCP_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                         "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                         "_MEM_FORMAT_ENCODING")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
SAFE_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch", name) for name in _DTYPES),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})
_DTYPE_OF = {getattr(torch, name): name for name in _DTYPES}


class RefusedGlobal(pickle.UnpicklingError):
    """A ``.metadata`` pickle names a global outside :data:`SAFE_GLOBALS`."""


class RefusedEntry(pickle.UnpicklingError):
    """A ``.metadata`` entry medley never writes: not a tensor, stored outside the step
    directory's data files, or behind a stream transform."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise RefusedGlobal(f"checkpoint metadata names {module}.{name}, which is not DCP metadata")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape(value: object) -> list[int] | None:
    """``value`` as a list of non-negative ints if it is a torch.Size of them, else None."""
    if not isinstance(value, torch.Size) or not all(_is_int(d) and d >= 0 for d in value):
        return None
    return list(value)


def _check_entry(key: object, entry: object) -> list[torch.Size]:
    """The chunk offsets of a valid tensor entry (attributes read with ``getattr``: a crafted
    pickle may leave any of them out)."""
    if not isinstance(key, str):
        raise RefusedEntry(f"it has a key {key!r} that is not a name")
    if not isinstance(entry, TensorStorageMetadata):
        raise RefusedEntry(f"entry {key!r} is {type(entry).__name__}, not a tensor: medley "
                           "writes only tensors (DCP would unpickle bytes entries, which can run code)")
    size = _shape(getattr(entry, "size", None))
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    if size is None or not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_OF:
        raise RefusedEntry(f"entry {key!r} has no valid shape or dtype")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list) or not chunks:
        raise RefusedEntry(f"entry {key!r} has no chunks")
    volume, offsets_seen = 0, []
    for chunk in chunks:
        offsets = _shape(getattr(chunk, "offsets", None))
        sizes = _shape(getattr(chunk, "sizes", None))
        if (not isinstance(chunk, ChunkStorageMetadata) or offsets is None or sizes is None
                or len(offsets) != len(size) or len(sizes) != len(size)
                or any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True))):
            raise RefusedEntry(f"entry {key!r} has a chunk outside its shape {size}")
        volume += math.prod(sizes)
        offsets_seen.append(chunk.offsets)
    if volume != math.prod(size) or len(set(offsets_seen)) != len(offsets_seen):
        raise RefusedEntry(f"entry {key!r} has chunks that do not cover its shape {size} once")
    return offsets_seen


def _check_storage(storage: object, chunks: set[MetadataIndex]) -> None:
    """Each chunk (``chunks``) stored once, in a DCP data file, in bytes no other chunk uses."""
    if not isinstance(storage, dict):
        raise RefusedEntry("it has no storage table")
    extents = []
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or index not in chunks:
            raise RefusedEntry(f"it stores {fqn!r} at {getattr(index, 'offset', None)!r}, which is no chunk "
                               "of its entries")
        path = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(path, str) or not _DATA_FILE.fullmatch(path):
            raise RefusedEntry(f"entry {fqn!r} is stored in {path!r}, which is not a DCP "
                               "data file of the step directory")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)  # may be left out
        if not (_is_int(offset) and _is_int(length) and offset >= 0 and length >= 0):
            raise RefusedEntry(f"entry {fqn!r} has an invalid offset or length")
        if getattr(info, "transform_descriptors", None):
            raise RefusedEntry(f"entry {fqn!r} is stored behind a stream transform "
                               f"({info.transform_descriptors!r}), which medley never writes")
        extents.append((path, offset, length, fqn))
    missing = next(iter(chunks - set(storage)), None)
    if missing is not None:
        raise RefusedEntry(f"entry {missing.fqn!r} has a chunk at {list(missing.offset or ())} with no "
                           "storage")
    extents.sort()
    for (file, start, length, fqn), (next_file, next_start, _, next_fqn) in zip(extents, extents[1:],
                                                                                 strict=False):
        if file == next_file and start + length > next_start:  # DCP writes each chunk once, end to end
            raise RefusedEntry(f"entries {fqn!r} and {next_fqn!r} are stored in overlapping bytes of {file}")


def check_dcp_metadata(metadata: object) -> Metadata:
    """``metadata`` if it is DCP metadata of tensors only, each stored in a DCP data file of the
    step directory (a plain ``__R_N.distcp`` name) without transforms; else :class:`RefusedEntry`."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
        raise RefusedEntry("it does not hold DCP metadata")
    chunks = {MetadataIndex(key, offsets) for key, entry in entries.items()
              for offsets in _check_entry(key, entry)}
    _check_storage(getattr(metadata, "storage_data", None), chunks)
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for the ``.metadata`` file, which refuses
    any entry medley does not write (:func:`check_dcp_metadata`). ``metadata``: one already read
    and checked, handed to DCP instead of reading the file again. ``read_metadata`` takes no
    ``rank``: DCP then never falls back to a rank's own ``__R.metadata`` file."""

    def __init__(self, path: str | os.PathLike, *, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.checked = metadata

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if self.checked is not None:
            metadata = self.checked
        else:
            path = self._get_metadata_path()
            with self.fs.create_stream(path, "rb") as handle:
                try:
                    loaded = _MetadataUnpickler(handle).load()
                except RefusedGlobal:
                    raise
                except Exception as err:  # truncated or garbled: UnpicklingError, EOFError, ValueError, ...
                    raise pickle.UnpicklingError(f"{path} is not readable DCP metadata ({err})") from None
            if not isinstance(loaded, Metadata):
                raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
            metadata = check_dcp_metadata(loaded)
        if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner that refuses bytes entries instead of unpickling them."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise RefusedEntry(f"entry {read_item.dest_index.fqn!r} is bytes, which medley "
                           "never writes")


def entry_of(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor's manifest entry: kind, dtype and global shape (a DTensor's, not its shard's)."""
    return {"kind": "tensor", "dtype": _DTYPE_OF.get(tensor.dtype, str(tensor.dtype)),
            "shape": list(tensor.shape)}


def manifest_of(metadata: Metadata) -> dict[str, dict[str, Any]]:
    """The manifest ``medley.json`` records for the DCP metadata of a save: every key, its kind,
    dtype and global shape."""
    return {key: {"kind": "tensor", "dtype": _DTYPE_OF[entry.properties.dtype], "shape": list(entry.size)}
            for key, entry in sorted(metadata.state_dict_metadata.items())
            if isinstance(entry, TensorStorageMetadata)}


def resume_fix(path: Path) -> str:
    """The fix a refused resume names: the step is one medley made in the user's directory."""
    return f"delete {path} to resume from the checkpoint before it, or use another --checkpoint-dir"


EXPORT_FIX = "export another step"


def _valid_entry(entry: object) -> bool:
    return (isinstance(entry, dict) and set(entry) == {"kind", "dtype", "shape"} and entry["kind"] == "tensor"
            and entry["dtype"] in _DTYPES and isinstance(entry["shape"], list)
            and all(_is_int(d) and d >= 0 for d in entry["shape"]))


def read_meta(path: Path, *, fix: str) -> dict[str, Any]:
    """``path``'s medley.json, checked: format :data:`FORMAT`, a non-empty file list of plain names
    with a sha256 each (``.metadata`` among them) and a non-empty list of entries. Anything
    else is a :class:`MedleyInputError` ending in ``fix``."""
    meta_path = Path(path) / META_FILE
    try:
        mode = os.lstat(meta_path).st_mode
    except FileNotFoundError:
        raise MedleyInputError(f"checkpoint {path}: no {META_FILE}, so this is not a medley checkpoint step; "
                               "give a step directory (CHECKPOINT_DIR/step-N)") from None
    except OSError as err:
        raise MedleyInputError(f"checkpoint {meta_path}: unreadable ({err.strerror}); {fix}") from None
    if not stat.S_ISREG(mode):
        raise MedleyInputError(f"checkpoint {meta_path}: not a regular file (a link or a device); {fix}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise MedleyInputError(f"checkpoint {meta_path}: unreadable or not JSON ({err}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise MedleyInputError(
            f"checkpoint {path}: {META_FILE} is format {found!r}, not {FORMAT} (format 3 lists every tensor "
            "entry, so that a load reads only what medley wrote); use it with the medley that wrote it, or "
            f"{fix}")
    files = meta.get("files")
    if (not isinstance(files, dict) or METADATA_FILE not in files
            or not all(isinstance(n, str) and _PLAIN_NAME.fullmatch(n) and n not in (".", "..", META_FILE)
                       and isinstance(d, str) and _SHA256.fullmatch(d) for n, d in files.items())):
        raise MedleyInputError(
            f"checkpoint {path}: {META_FILE}'s \"files\" must give a sha256 for {METADATA_FILE} and every "
            f"data file of the step (plain names in the step directory); {fix}")
    entries = meta.get("entries")
    if not isinstance(entries, dict) or not entries or not all(
            isinstance(k, str) and _valid_entry(e) for k, e in entries.items()):
        raise MedleyInputError(
            f"checkpoint {path}: {META_FILE}'s \"entries\" must list every tensor (kind, dtype, shape); "
            f"{fix}")
    return meta


def listed_files(path: Path, meta: dict[str, Any], *, fix: str) -> list[str]:
    """The files ``medley.json`` lists, each a regular file of the step directory itself (not a
    link: it could point anywhere)."""
    names = sorted(meta["files"])
    for name in names:
        file = Path(path) / name
        try:
            mode = os.lstat(file).st_mode
        except FileNotFoundError:
            raise MedleyInputError(f"checkpoint {file}: missing; {fix}") from None
        except OSError as err:
            raise MedleyInputError(f"checkpoint {file}: unreadable ({err.strerror}); {fix}") from None
        if not stat.S_ISREG(mode):
            raise MedleyInputError(f"checkpoint {file}: not a regular file (a link, a directory or a "
                                   f"device); {fix}")
    return names


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_hashes(path: Path, meta: dict[str, Any], actual: Mapping[str, str], *, fix: str) -> None:
    """Every listed file has the sha256 ``medley.json`` gives for it (``actual``: computed)."""
    listed: dict[str, str] = meta["files"]
    bad = next((name for name in sorted(listed) if actual.get(name) != listed[name]), None)
    if bad is not None:
        raise MedleyInputError(f"checkpoint {Path(path) / bad}: its content changed since it was saved "
                               f"(sha256 mismatch); {fix}")


def checked_metadata(path: Path, meta: dict[str, Any], *, fix: str) -> Metadata:
    """``path``'s ``.metadata``, read safely (:class:`SafeReader`), holding exactly the entries of
    ``medley.json`` (key, dtype, shape), each stored within a file it lists."""
    path = Path(path)
    try:
        metadata = SafeReader(path).read_metadata()
    except (RefusedGlobal, RefusedEntry) as err:
        raise MedleyInputError(f"checkpoint {path / METADATA_FILE}: {err}; {fix}") from None
    except (pickle.UnpicklingError, OSError) as err:
        raise MedleyInputError(f"checkpoint {path} is corrupt ({err}); {fix}") from None
    saved, entries = manifest_of(metadata), meta["entries"]
    key = next((k for k in sorted(set(saved) | set(entries)) if saved.get(k) != entries.get(k)), None)
    if key is not None:
        raise MedleyInputError(
            f"checkpoint {path}: entry {key!r} is {_described(saved.get(key))} in {METADATA_FILE} but "
            f"{_described(entries.get(key))} in {META_FILE}; {fix}")
    sizes = {name: os.lstat(path / name).st_size for name in meta["files"]}
    for index, info in metadata.storage_data.items():
        if info.relative_path not in sizes:
            raise MedleyInputError(
                f"checkpoint {path}: entry {index.fqn!r} is stored in {info.relative_path}, which "
                f"{META_FILE}'s file list does not cover (no sha256); {fix}")
        if info.offset + info.length > sizes[info.relative_path]:
            raise MedleyInputError(
                f"checkpoint {path / info.relative_path}: entry {index.fqn!r} lies beyond the end of the "
                f"file; {fix}")
    return metadata


def _described(entry: dict[str, Any] | None) -> str:
    return "absent" if entry is None else f"{entry['kind']} {entry['dtype']} {entry['shape']}"


def check_entries(path: Path, entries: dict[str, dict[str, Any]], expected: dict[str, dict[str, Any]], *,
                  optional: set[str], what: str, fix: str) -> None:
    """The checkpoint's ``entries`` are exactly those ``expected`` (the tensors of the model and
    optimizer loading it: same kind, dtype, shape). A key of ``optional`` may be missing, and a
    ``train.*`` scalar the loader does not know may be there (the loss scale of an fp16 run
    resumed in bf16); nothing else differs. ``what`` names the loader ("this run", "the model")."""
    for key in sorted(expected):
        if key not in entries:
            if key in optional:
                continue
            raise MedleyInputError(f"checkpoint {path}: has no entry {key!r}, which {what} has; {fix}")
        if entries[key] != expected[key]:
            raise MedleyInputError(f"checkpoint {path}: entry {key!r} is {_described(entries[key])} but "
                                   f"{_described(expected[key])} in {what}; {fix}")
    for key in sorted(set(entries) - set(expected)):
        if not (key.startswith("train.") and entries[key]["shape"] == []):
            raise MedleyInputError(f"checkpoint {path}: has an entry {key!r} that {what} does not have (a "
                                   f"checkpoint of another model or optimizer); {fix}")


Hashes = Callable[[Path, list[str]], dict[str, str]]
"""sha256 of the named files of a directory (a resume shares the hashing out over its ranks)."""


def local_hashes(directory: Path, names: list[str]) -> dict[str, str]:
    """:data:`Hashes` computed by this process alone."""
    return {name: sha256_of(directory / name) for name in names}


def verified_metadata(path: Path, meta: dict[str, Any], *, fix: str,
                      hashes: Hashes = local_hashes) -> Metadata:
    """The ``.metadata`` of the checkpoint at ``path`` once its files match the hashes of its
    ``medley.json`` (``meta``, :func:`read_meta`) and its entries the entries listed there; no
    tensor is read. Each refusal is one :class:`MedleyInputError` ending in ``fix``."""
    check_hashes(path, meta, hashes(path, listed_files(path, meta, fix=fix)), fix=fix)
    return checked_metadata(path, meta, fix=fix)


def failures_of(err: BaseException) -> list[BaseException]:
    """The exceptions behind ``err``: each rank's for DCP's gathered CheckpointException."""
    if isinstance(err, CheckpointException):
        return [exc for exc, _ in err.failures.values()]
    return [err]


def load_tensors(states: list[dict[str, torch.Tensor]], path: Path, metadata: Metadata, *, what: str,
                 fix: str, no_dist: bool = False) -> None:
    """Fill each of ``states`` in place from the checkpoint at ``path`` (its :func:`verified_metadata`),
    tensors only; collective unless ``no_dist``. A failure is one :class:`MedleyInputError` saying
    the checkpoint is corrupt or does not match ``what``."""
    try:
        with warnings.catch_warnings():
            if no_dist:  # "torch.distributed is ... uninitialized": it is meant to be
                warnings.simplefilter("ignore", UserWarning)
            for state in states:
                dcp.load(state, storage_reader=SafeReader(path, metadata=metadata),
                         planner=TensorsOnlyPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure (a BaseException)
        failures = failures_of(err)
        reason = f"{type(failures[0]).__name__}: {failures[0]}" if failures else type(err).__name__
        raise MedleyInputError(printable(f"checkpoint {path} is corrupt or does not match {what} "
                                         f"({reason.strip().splitlines()[0][:300]}); {fix}")) from None
