"""Export a medley checkpoint step as a Hugging Face model directory (``medley export``,
``medley train --export-hf``).

A step directory is DCP with plan-independent names (:mod:`medley.runtime.checkpoint`), so one
process without a process group reads the whole model from it, whatever plan wrote it. The
output holds the weights in safetensors (shards with ``model.safetensors.index.json`` above
``max_shard_bytes``), a ``config.json`` made from the checkpoint's model and copies of the
tokenizer files of the Hugging Face directory the run came from (recorded as ``hf_dir`` in
``medley.json``). It is written into a new temporary directory (each file created new, never
through a link) renamed into place; a failed write (disk full) removes it and is one line.
The step is checked as a resume checks it (:mod:`medley.runtime.checkpoint_verify`): its
``model.*`` entries must be exactly the parameters of the model medley.json names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from medley.errors import MedleyInputError
from medley.fileio import os_error_message, read_user_bytes, remove_path, write_new_file
from medley.runtime.checkpoint_verify import (
    EXPORT_FIX,
    check_entries,
    entry_of,
    load_tensors,
    read_meta,
    verified_metadata,
)
from medley.runtime.hf_names import check_hf_family, hf_name
from medley.runtime.hf_weights import INDEX_FILE, SINGLE_FILE
from medley.runtime.transformer import Decoder
from medley.spec.cluster_schema import printable
from medley.spec.hf_config import hf_dict_from_spec
from medley.spec.model import ModelSpec

MAX_SHARD_BYTES = 5 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _write_weights(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """The safetensors files (serialized in memory, a shard at a time, then written by
    :func:`write_new_file`: a full disk is an OSError naming the file, not a SafetensorError)."""
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_new_file(directory / SINGLE_FILE, save(shards[0], metadata={"format": "pt"}))
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_new_file(directory / file, save(shard, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_new_file(directory / INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                                       "weight_map": weight_map}, indent=1))


def _write_config(directory: Path, spec: ModelSpec, hf_dir: Path | None) -> None:
    """config.json from the spec, with the token ids of the original config; the tokenizer files."""
    cfg = hf_dict_from_spec(spec)
    if hf_dir is not None and (hf_dir / "config.json").is_file():
        try:
            original = json.loads(read_user_bytes(hf_dir / "config.json", what="model config"))
        except (MedleyInputError, ValueError):
            original = {}
        if isinstance(original, dict):
            cfg.update({key: original[key] for key in _TOKEN_IDS if key in original})
    write_new_file(directory / "config.json", json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES if hf_dir is not None else ():
        if (hf_dir / name).is_file():
            write_new_file(directory / name, read_user_bytes(hf_dir / name, what="tokenizer file"))


def export_hf(step_dir: Path, out: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write checkpoint ``step_dir`` as a Hugging Face model directory at ``out`` (atomically: a
    temporary directory renamed into place; an existing ``out`` is refused)."""
    out = Path(out)
    if os.path.lexists(out):
        raise MedleyInputError(printable(f"--hf {out}: already exists; give a new directory (the export "
                                         "creates it)"))
    spec, params, meta = read_model_tensors(step_dir)
    tensors = {hf_name(name): tensor.contiguous() for name, tensor in params.items()}
    hf_dir = Path(meta["hf_dir"]) if isinstance(meta.get("hf_dir"), str) else None
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    try:
        remove_path(tmp)
        tmp.mkdir(parents=True)
        _write_weights(tmp, tensors, max_shard_bytes)
        _write_config(tmp, spec, hf_dir)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        os.rename(tmp, out)
    except OSError as err:
        remove_path(tmp)
        raise MedleyInputError(printable(os_error_message(out, err))) from None
    except BaseException:
        remove_path(tmp)
        raise
    return out
