"""Read a Hugging Face model directory's safetensors weights (``--init-from``), checked.

A directory holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Tensors are read lazily with ``safetensors.safe_open``: a reader opens only the files that hold
the tensors it asks for and reads only those. :func:`check_tensors` reads the headers alone
(names, shapes and dtypes), so a missing, extra or mis-shaped tensor is one line before any rank
starts; :func:`checked_slices` hands out each asked-for tensor as a lazy slice after the same
checks. Parameters are named as medley names them (:mod:`medley.hf.names` maps them).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from medley.errors import MedleyInputError
from medley.fileio import check_regular_file, read_user_json
from medley.hf.names import check_hf_family, hf_name
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors transformers itself ignores when loading: old checkpoints' rotary-embedding buffers.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

Named = Iterable[tuple[str, torch.Tensor]]
"""(medley name, parameter) pairs: what a reader wants, with the shape it needs."""


def tensor_files(directory: Path) -> dict[str, Path]:
    """The file holding each tensor of the model directory (from the index, or the single file's header)."""
    directory = Path(directory)
    index, single = directory / INDEX_FILE, directory / SINGLE_FILE
    fix = "give a Hugging Face model directory saved with safetensors"
    try:
        if index.exists():
            raw = read_user_json(index, what="weights index", fix=fix)
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("no 'weight_map' object of tensor name -> file name")
            return {name: directory / Path(file).name for name, file in weight_map.items()}
        if single.exists():
            check_regular_file(single, what="model weights file")
            with safe_open(single, framework="pt") as handle:
                return dict.fromkeys(handle.keys(), single)
    except (OSError, ValueError, AttributeError, SafetensorError) as err:
        if isinstance(err, MedleyInputError):
            raise MedleyInputError(printable(str(err))) from None
        path = index if index.exists() else single
        raise MedleyInputError(printable(f"{path}: cannot read it ({err}); {fix}")) from None
    raise MedleyInputError(printable(f"--init-from {directory}: neither {SINGLE_FILE} nor {INDEX_FILE} is "
                                     "there; give a Hugging Face model directory saved with safetensors"))


def _by_file(named: Named, files: dict[str, Path], directory: Path
             ) -> dict[Path, list[tuple[str, str, torch.Tensor]]]:
    """(medley name, transformers name, parameter) grouped by the file to read."""
    groups: dict[Path, list[tuple[str, str, torch.Tensor]]] = defaultdict(list)
    for name, param in named:
        hf = hf_name(name)
        if hf not in files:
            where = directory / (INDEX_FILE if (directory / INDEX_FILE).is_file() else SINGLE_FILE)
            raise MedleyInputError(printable(f"{where}: tensor '{hf}' (medley's {name}) is missing; give "
                                             "the directory of a model that matches --model"))
        groups[files[hf]].append((name, hf, param))
    return groups


def _check_slice(file: Path, hf: str, name: str, piece: Any, want: torch.Size) -> None:
    """The tensor has the parameter's shape and floating-point values: an int32 or bool tensor
    was once cast into the model silently."""
    got = piece.get_shape()
    if list(got) != list(want):
        raise MedleyInputError(printable(
            f"{file}: tensor '{hf}' has shape {list(got)} but medley's {name} needs {list(want)}; give the "
            "directory of a model that matches --model"))
    dtype = piece.get_dtype()
    if not (dtype.startswith("F") or dtype == "BF16"):
        raise MedleyInputError(printable(
            f"{file}: tensor '{hf}' holds {dtype} values, not floating-point weights; give the directory "
            "of a model saved with float weights"))


def _check_no_extra(files: dict[str, Path], wanted: set[str], spec: ModelSpec) -> None:
    """Every tensor of the directory is one the model reads (transformers' ignored leftovers
    aside): ``model.layers.5.*`` for a 4-block model was once skipped silently."""
    ignored = {"lm_head.weight"} if spec.tied_embeddings else set()
    extra = sorted(name for name in files if name not in wanted and name not in ignored
                   and not _IGNORED.fullmatch(name))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MedleyInputError(printable(
            f"{files[extra[0]]}: tensor '{extra[0]}'{more} is not part of --model '{spec.name}' "
            f"({spec.num_blocks} blocks); give the directory of a model that matches --model"))


def check_tensors(spec: ModelSpec, named: Named, directory: Path) -> None:
    """Every parameter of ``named`` (the whole model's) is in ``directory`` with its shape and a
    floating-point dtype, and no other tensor is there (headers only, no data)."""
    check_hf_family(spec, what=f"--init-from {directory}")
    files = tensor_files(directory)
    groups = _by_file(named, files, Path(directory))
    _check_no_extra(files, {hf for entries in groups.values() for _, hf, _ in entries}, spec)
    for file, entries in groups.items():
        check_regular_file(file, what="model weights file")
        try:
            with safe_open(file, framework="pt") as handle:
                for name, hf, param in entries:
                    _check_slice(file, hf, name, handle.get_slice(hf), param.shape)
        except (OSError, KeyError, SafetensorError) as err:
            raise MedleyInputError(printable(f"{file}: cannot read it ({err}); the index names tensors "
                                             "this file lacks, or it is damaged")) from None


def checked_slices(spec: ModelSpec, named: Named, directory: Path
                   ) -> Iterator[tuple[Path, str, torch.Tensor, Any]]:
    """(file, transformers name, parameter, lazy slice) for each parameter of ``named``, a file at
    a time and only the files that hold them, each slice checked as :func:`check_tensors` checks
    it; index the slice to read (part of) its data."""
    check_hf_family(spec, what=f"--init-from {directory}")
    for file, entries in _by_file(named, tensor_files(directory), Path(directory)).items():
        check_regular_file(file, what="model weights file")
        with safe_open(file, framework="pt") as handle:
            for name, hf, param in entries:
                piece = handle.get_slice(hf)
                _check_slice(file, hf, name, piece, param.shape)
                yield file, hf, param, piece
