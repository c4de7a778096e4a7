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
from medley.hf.names import check_hf_family, hf_name, peft_name
from medley.hf.write import MAX_SHARD_BYTES, check_new_dir, write_adapter_dir, write_model_dir
from medley.runtime.checkpoint_verify import (
    EXPORT_FIX,
    check_entries,
    entry_of,
    load_tensors,
    read_meta,
    verified_metadata,
)
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.lora import LORA_A, LORA_B, is_adapter_name
from medley.runtime.sharding import TORCH_DTYPES
from medley.runtime.transformer import Decoder
from medley.spec.adapter import LoraSpec
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


def checkpoint_adapter(step_dir: Path, meta: dict[str, Any]) -> LoraSpec | None:
    """The LoRA adapter a checkpoint's run trained (medley.json's ``adapter``), None for full training."""
    recorded = meta.get("adapter")
    if recorded is None:
        return None
    try:
        return LoraSpec(**{**recorded, "targets": tuple(recorded["targets"])})
    except (KeyError, TypeError, ValueError) as err:
        raise MedleyInputError(printable(f"checkpoint {step_dir}: medley.json's adapter is not one this "
                                         f"medley reads ({err}); export it with the medley that wrote it")) \
            from None


def read_model_tensors(step_dir: Path) -> tuple[ModelSpec, dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's model, its parameters by medley name (full tensors) and its medley.json; a
    LoRA run's checkpoint holds its adapters only."""
    step_dir = Path(step_dir)
    meta = read_meta(step_dir, fix=EXPORT_FIX)
    spec = _checkpoint_model(step_dir, meta)
    adapter = checkpoint_adapter(step_dir, meta)
    metadata = verified_metadata(step_dir, meta, fix=EXPORT_FIX)
    with torch.device("meta"):
        params = {name: p for name, p in Decoder(spec, init=False, adapter=adapter).named_parameters()
                  if adapter is None or is_adapter_name(name)}
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
              flag: str = "--dtype", merge: bool = False) -> Path:
    """Write checkpoint ``step_dir`` as a Hugging Face model directory at ``out`` (atomically: a
    temporary directory renamed into place; an existing ``out`` is refused), its weights cast to
    ``dtype`` (fp32, bf16 or fp16: half the bytes; a weight beyond fp16's range is refused in one
    line naming ``flag`` rather than written as infinity).

    A LoRA run's checkpoint is written as PEFT's adapter directory (for ``PeftModel.from_pretrained``
    over the base it started from), or with ``merge`` as a whole model: each adapted weight
    ``W + (alpha / rank) B A``, the base read again from the run's ``--init-from`` (else drawn from
    its seed)."""
    torch_dtype = check_export_dtype(dtype, flag=flag)
    check_new_dir(Path(out))
    spec, params, meta = read_model_tensors(step_dir)
    adapter = checkpoint_adapter(Path(step_dir), meta)
    hf_dir = Path(meta["hf_dir"]) if isinstance(meta.get("hf_dir"), str) else None
    if adapter is not None and not merge:
        base = Path(meta["init_from"]) if isinstance(meta.get("init_from"), str) else hf_dir
        return write_adapter_dir(out, adapter, {peft_name(name): _cast(name, tensor, torch_dtype, flag)
                                                for name, tensor in params.items()}, base=base)
    if adapter is not None:
        params = merged_weights(spec, adapter, params, meta, step_dir=Path(step_dir))
    tensors = {hf_name(name): _cast(name, tensor, torch_dtype, flag) for name, tensor in params.items()}
    return write_model_dir(out, spec, tensors, hf_dir=hf_dir, max_shard_bytes=max_shard_bytes,
                           dtype=str(torch_dtype).removeprefix("torch."))


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype, flag: str) -> torch.Tensor:
    cast = tensor.to(dtype).contiguous()
    if not bool(torch.isfinite(cast).all()) and bool(torch.isfinite(tensor).all()):
        text = next(key for key, value in TORCH_DTYPES.items() if value == dtype)  # as the flag names it
        raise MedleyInputError(f"{flag} {text}: {name} has values beyond {text}'s range (largest "
                               f"{float(tensor.abs().max()):.3g}); export bf16 or fp32")
    return cast


def merged_weights(spec: ModelSpec, adapter: LoraSpec, adapters: dict[str, torch.Tensor],
                   meta: dict[str, Any], *, step_dir: Path) -> dict[str, torch.Tensor]:
    """The base model's weights with each adapter folded in (``W + scale B A``), by medley name."""
    init_from = meta.get("init_from")
    if isinstance(init_from, str):
        if not Path(init_from).is_dir():
            raise MedleyInputError(printable(f"checkpoint {step_dir}: its run's --init-from {init_from} is "
                                             "gone; --merge needs the base weights there (or export the "
                                             "adapter without --merge)"))
        base = Decoder(spec, init=False)
        load_hf_weights(base, Path(init_from))
    else:
        base = Decoder(spec, seed=int(meta.get("seed", 0)))
    weights = {name: p.detach() for name, p in base.named_parameters()}
    for name, lora_a in adapters.items():
        if name.endswith(LORA_A):  # <layer>.lora_a, with <layer>.lora_b beside it
            layer = name.removesuffix(LORA_A)
            delta = adapters[f"{layer}{LORA_B}"] @ lora_a
            weights[f"{layer}weight"] = weights[f"{layer}weight"] + adapter.scale * delta
    return weights
