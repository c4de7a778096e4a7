"""Export a medley checkpoint step as a Hugging Face model directory (``medley export``,
``medley train --export-hf``).

A step directory is DCP with plan-independent names (:mod:`medley.runtime.checkpoint`), so one
process without a process group reads the whole model from it, whatever plan wrote it. The step
is checked as a resume checks it (:mod:`medley.runtime.checkpoint_verify`): its ``model.*``
entries must be exactly the parameters of the model medley.json names. The directory is written
by :func:`medley.hf.write.write_model_dir` (weights, config, and the tokenizer files of the
Hugging Face directory the run came from, recorded as ``hf_dir`` in ``medley.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from medley.errors import MedleyInputError
from medley.hf.names import check_hf_family, hf_name
from medley.hf.write import MAX_SHARD_BYTES, check_new_dir, write_model_dir
from medley.runtime.checkpoint_verify import (
    EXPORT_FIX,
    check_entries,
    entry_of,
    load_tensors,
    read_meta,
    verified_metadata,
)
from medley.runtime.sharding import TORCH_DTYPES
from medley.runtime.transformer import Decoder
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec


def _checkpoint_model(step_dir: Path, meta: dict[str, Any]) -> ModelSpec:
    try:
        spec = ModelSpec(**meta["model"])
    except (KeyError, TypeError, MedleyInputError) as err:
        raise MedleyInputError(printable(f"checkpoint {step_dir}: medley.json's model is not one this medley "
                                         f"reads ({err}); export it with the medley that wrote it")) from None
    check_hf_family(spec, what=f"checkpoint {step_dir}")
    return spec


def read_model_tensors(step_dir: Path) -> tuple[ModelSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's model, its parameters by medley name (full tensors) and its medley.json."""
    step_dir = Path(step_dir)
    meta = read_meta(step_dir, fix=EXPORT_FIX)
    spec = _checkpoint_model(step_dir, meta)
    metadata = verified_metadata(step_dir, meta, fix=EXPORT_FIX)
    with torch.device("meta"):
        params = dict(Decoder(spec, init=False).named_parameters())
    expected = {f"model.{name}": entry_of(param) for name, param in params.items()}
    model_entries = {key: entry for key, entry in meta["entries"].items() if key.startswith("model.")}
    check_entries(step_dir, model_entries, expected, optional=set(),
                  what=f"the model medley.json names ({spec.num_blocks} blocks)", fix=EXPORT_FIX)
    state = {f"model.{name}": torch.empty(param.shape, dtype=param.dtype) for name, param in params.items()}
    load_tensors([state], step_dir, metadata, what="the model medley.json names", fix=EXPORT_FIX,
                 no_dist=True)
    return spec, {name: state[f"model.{name}"] for name in params}, meta


def check_export_dtype(dtype: str, *, flag: str) -> torch.dtype:
    """The torch dtype of an export's ``dtype`` (a precision name: fp32, bf16, fp16)."""
    if dtype not in TORCH_DTYPES:
        raise MedleyInputError(f"{flag} {printable(dtype)}: must be one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[dtype]


def export_hf(step_dir: Path, out: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES, dtype: str = "fp32",
              flag: str = "--dtype") -> Path:
    """Write checkpoint ``step_dir`` as a Hugging Face model directory at ``out`` (atomically: a
    temporary directory renamed into place; an existing ``out`` is refused), its weights cast to
    ``dtype`` (fp32, bf16 or fp16: half the bytes; a weight beyond fp16's range is refused in one
    line naming ``flag`` rather than written as infinity)."""
    torch_dtype = check_export_dtype(dtype, flag=flag)
    check_new_dir(Path(out))
    spec, params, meta = read_model_tensors(step_dir)
    tensors = {}
    for name, tensor in params.items():
        cast = tensor.to(torch_dtype).contiguous()
        if not bool(torch.isfinite(cast).all()) and bool(torch.isfinite(tensor).all()):
            raise MedleyInputError(f"{flag} {dtype}: {name} has values beyond {dtype}'s range (largest "
                                   f"{float(tensor.abs().max()):.3g}); export bf16 or fp32")
        tensors[hf_name(name)] = cast
    hf_dir = Path(meta["hf_dir"]) if isinstance(meta.get("hf_dir"), str) else None
    return write_model_dir(out, spec, tensors, hf_dir=hf_dir, max_shard_bytes=max_shard_bytes,
                           dtype=str(torch_dtype).removeprefix("torch."))
