"""Read a Hugging Face model directory's safetensors weights into medley's layers (``--init-from``).

A directory holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
Tensors are read lazily with ``safetensors.safe_open``: a stage opens only the files that hold its
own layers' tensors and reads only those. :func:`check_hf_weights` reads the headers alone (names
and shapes), so a missing or mis-shaped tensor is one line before any rank starts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from medley.errors import MedleyInputError
from medley.fileio import check_regular_file, read_user_json
from medley.runtime.hf_names import check_hf_family, hf_name
from medley.runtime.materialize import local_box
from medley.runtime.tensor_parallel import local_tensor
from medley.runtime.transformer import Decoder
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors transformers itself ignores when loading: old checkpoints' rotary-embedding buffers.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


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


def _by_file(named: Iterable[tuple[str, torch.Tensor]], files: dict[str, Path], directory: Path
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


def _shape_error(file: Path, hf: str, name: str, got: list[int], want: torch.Size) -> MedleyInputError:
    return MedleyInputError(printable(
        f"{file}: tensor '{hf}' has shape {list(got)} but medley's {name} needs {list(want)}; give the "
        "directory of a model that matches --model"))


def _check_dtype(file: Path, hf: str, dtype: str) -> None:
    """Only floating-point tensors go into the (floating-point) parameters: an int32 or bool
    tensor was once cast into the model silently."""
    if not (dtype.startswith("F") or dtype == "BF16"):
        raise MedleyInputError(printable(
            f"{file}: tensor '{hf}' holds {dtype} values, not floating-point weights; give the directory "
            "of a model saved with float weights"))


def _check_no_extra(files: dict[str, Path], wanted: set[str], spec: ModelSpec, directory: Path) -> None:
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


def check_hf_weights(spec: ModelSpec, directory: Path) -> None:
    """Every tensor the model needs is in ``directory`` with its shape and a floating-point
    dtype, and no other tensor is there (headers only, no data)."""
    check_hf_family(spec, what=f"--init-from {directory}")
    with torch.device("meta"):
        model = Decoder(spec, init=False)
    files = tensor_files(directory)
    groups = _by_file(model.named_parameters(), files, Path(directory))
    _check_no_extra(files, {hf for entries in groups.values() for _, hf, _ in entries}, spec, Path(directory))
    for file, entries in groups.items():
        check_regular_file(file, what="model weights file")
        try:
            with safe_open(file, framework="pt") as handle:
                for name, hf, param in entries:
                    piece = handle.get_slice(hf)
                    shape = piece.get_shape()
                    if list(shape) != list(param.shape):
                        raise _shape_error(file, hf, name, shape, param.shape)
                    _check_dtype(file, hf, piece.get_dtype())
        except (OSError, KeyError, SafetensorError) as err:
            raise MedleyInputError(printable(f"{file}: cannot read it ({err}); the index names tensors "
                                             "this file lacks, or it is damaged")) from None


def load_hf_weights(module: Decoder, directory: Path) -> None:
    """Fill ``module``'s parameters (a stage or the whole model) from ``directory``, reading only
    the tensors of its own layers."""
    load_hf_tensors(module.spec, module.named_parameters(), directory)


def load_hf_tensors(spec: ModelSpec, named: Iterable[tuple[str, torch.Tensor]], directory: Path) -> None:
    """Fill parameters given by medley name from ``directory``: a plain one with its whole tensor,
    a TP slice or ZeRO-1/2/3 shard (DTensor) with only its own box of it (read as a slice of the
    file, :func:`medley.runtime.materialize.local_box`)."""
    check_hf_family(spec, what=f"--init-from {directory}")
    with torch.no_grad():
        for file, entries in _by_file(named, tensor_files(directory), Path(directory)).items():
            check_regular_file(file, what="model weights file")
            with safe_open(file, framework="pt") as handle:
                for name, hf, param in entries:
                    piece = handle.get_slice(hf)
                    if list(piece.get_shape()) != list(param.shape):
                        raise _shape_error(file, hf, name, piece.get_shape(), param.shape)
                    _check_dtype(file, hf, piece.get_dtype())
                    local = local_tensor(param)
                    if local.numel():  # a short dim-0 cut can leave a rank no rows
                        local.copy_(piece[local_box(param)] if local.dim() else piece[:])
                    if not bool(torch.isfinite(local).all()):
                        raise MedleyInputError(printable(
                            f"{file}: tensor '{hf}' holds NaN or infinite values; give the directory of "
                            "a model whose weights are finite"))
