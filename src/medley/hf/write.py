"""Write a Hugging Face model directory: safetensors weights, ``config.json`` and the tokenizer's
files, atomically.

The weights are one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
above ``max_shard_bytes``; ``config.json`` is made from the model spec with the token ids of the
original directory's config; the tokenizer files are copied from that directory. Everything is
written into a new temporary directory (each file created new, never through a link) renamed into
place; a failed write (disk full) removes it and is one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save

from medley.errors import MedleyInputError
from medley.fileio import os_error_message, read_user_bytes, remove_path, write_new_file
from medley.hf.read import INDEX_FILE, SINGLE_FILE
from medley.spec.adapter import HF_NAMES, LoraSpec
from medley.spec.cluster_schema import printable
from medley.spec.hf_config import hf_dict_from_spec
from medley.spec.model import ModelSpec

MAX_SHARD_BYTES = 5 * 2**30
ADAPTER_FILE = "adapter_model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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


def _write_config(directory: Path, spec: ModelSpec, hf_dir: Path | None, dtype: str) -> None:
    """config.json from the spec, with the token ids of the original config and the weights'
    ``dtype``; the tokenizer files."""
    cfg = {**hf_dict_from_spec(spec), "dtype": dtype}
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


def check_new_dir(out: Path) -> None:
    """``out`` does not exist yet (the export creates it): checked before anything is read."""
    if os.path.lexists(out):
        raise MedleyInputError(printable(f"--hf {out}: already exists; give a new directory (the export "
                                         "creates it)"))


def write_model_dir(out: Path, spec: ModelSpec, tensors: dict[str, torch.Tensor], *, hf_dir: Path | None,
                    max_shard_bytes: int = MAX_SHARD_BYTES, dtype: str = "float32") -> Path:
    """Write ``tensors`` (by transformers name, contiguous, in ``dtype``: config.json's name of
    it) and ``spec``'s config as a new model directory ``out`` (an existing ``out`` is refused),
    with the tokenizer files of ``hf_dir``."""
    return _write_dir(Path(out), lambda tmp: (_write_weights(tmp, tensors, max_shard_bytes),
                                               _write_config(tmp, spec, hf_dir, dtype)))


def write_adapter_dir(out: Path, lora: LoraSpec, tensors: dict[str, torch.Tensor], *,
                      base: Path | None) -> Path:
    """Write a LoRA adapter as PEFT saves one (``PeftModel.from_pretrained(base_model, out)`` loads
    it): ``adapter_model.safetensors`` (``tensors`` by PEFT name, :func:`medley.hf.names.peft_name`)
    and ``adapter_config.json``, whose ``base_model_name_or_path`` is ``base`` (the directory the
    run started from), and the base's tokenizer files."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": sorted(HF_NAMES[t] for t in lora.targets),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": None if base is None else str(base)}

    def fill(tmp: Path) -> None:
        write_new_file(tmp / ADAPTER_FILE, save(tensors, metadata={"format": "pt"}))
        write_new_file(tmp / "adapter_config.json", json.dumps(config, indent=1))
        for name in TOKENIZER_FILES if base is not None else ():
            if (base / name).is_file():
                write_new_file(tmp / name, read_user_bytes(base / name, what="tokenizer file"))

    return _write_dir(Path(out), fill)


def _write_dir(out: Path, fill: Callable[[Path], object]) -> Path:
    """A new directory ``out`` filled by ``fill`` in a temporary directory renamed into place."""
    check_new_dir(out)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    try:
        remove_path(tmp)
        tmp.mkdir(parents=True)
        fill(tmp)
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
