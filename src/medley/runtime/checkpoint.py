"""Checkpoints with torch.distributed.checkpoint (DCP), in a form no plan owns.

Keys are global: ``model.<parameter>`` (names such as ``blocks.2.attn.wq.weight`` do not depend
on the split), ``optim.<parameter>.<state>`` and ``train.next_step`` / ``train.rng``. Sharded
(ZeRO-2/3) tensors are saved as DTensors, replicated ones once (DCP drops the duplicates), and
ZeRO-1 state by the rank that owns it, so DCP can load a checkpoint into any other plan: other
pp, dp, split or ZeRO levels. The data position is the step (batches are a function of it).

Each save goes to ``.tmp-step-N`` and is renamed to ``step-N`` once complete, so a crash mid-save
leaves the previous checkpoint intact. ``medley.json`` beside the DCP files records the model,
data and optimizer, checked before any tensor is read. Loading never unpickles code: tensors are
read by DCP's ``weights_only`` loads and the DCP metadata through an unpickler that only accepts
the metadata classes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from medley.errors import MedleyInputError
from medley.runtime.optim import ensure_state, local_optimizer
from medley.runtime.sharding import ShardedStage

PREFIX = "step-"
META_FILE = "medley.json"
FORMAT = 1
KEEP = 2  # newest checkpoints kept; older ones are deleted after each save

# Globals a DCP .metadata pickle may name: its own dataclasses and a few torch/builtin types.
_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {
    ("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "getattr"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}
_TORCH_ATTRS = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                "bool", "strided", "contiguous_format", "preserve_format", "channels_last"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_SAFE_MODULE_PREFIXES) or (module, name) in _SAFE_GLOBALS or (
            module == "torch" and name in _TORCH_ATTRS
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not DCP metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for the ``.metadata`` file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def checkpoint_state(stages: dict[int, ShardedStage], *, for_load: bool) -> dict[str, torch.Tensor]:
    """This rank's tensors under their global keys (views: loading fills them in place)."""
    state: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        name_of = {}
        for name, param in stage.named_parameters_local():
            state[f"model.{name}"] = param.detach()
            name_of[param] = name
        for optimizer in stage.optimizers:
            if for_load:
                ensure_state(optimizer)
            local = local_optimizer(optimizer)
            for group in local.param_groups:
                for param in group["params"]:
                    for key, value in local.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            state[f"optim.{name_of[param]}.{key}"] = value
    state["train.next_step"] = torch.zeros((), dtype=torch.int64)
    state["train.rng"] = torch.get_rng_state()
    return state


def checkpoint_path(directory: Path, next_step: int) -> Path:
    return Path(directory) / f"{PREFIX}{next_step:08d}"


def latest_checkpoint(directory: Path | None) -> Path | None:
    """The complete checkpoint with the highest step under ``directory`` (None if there is none)."""
    if directory is None or not Path(directory).is_dir():
        return None
    done = [p for p in Path(directory).glob(f"{PREFIX}*") if (p / META_FILE).is_file()]
    return max(done, key=lambda p: p.name, default=None)


def save_checkpoint(directory: Path, *, next_step: int, stages: dict[int, ShardedStage],
                    meta: dict[str, Any]) -> Path:
    """Collective: every rank writes its shards; rank 0 publishes the directory atomically."""
    directory = Path(directory)
    final = checkpoint_path(directory, next_step)
    tmp = directory / f".tmp-{final.name}"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = checkpoint_state(stages, for_load=False)
    state["train.next_step"].fill_(next_step)
    dcp.save(state, storage_writer=FileSystemWriter(tmp, thread_count=1))
    if rank == 0:
        meta_path = tmp / META_FILE
        with open(meta_path, "w") as handle:
            json.dump({**meta, "format": FORMAT, "next_step": next_step}, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():  # the same step saved again after a restart
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in sorted(directory.glob(f"{PREFIX}*"), key=lambda p: p.name)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError) as err:
        raise MedleyInputError(
            f"checkpoint {path}: {META_FILE} is missing or corrupt ({err}); delete the directory or point "
            "--checkpoint-dir elsewhere") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise MedleyInputError(
            f"checkpoint {path}: {META_FILE} is not a medley checkpoint of format {FORMAT}")
    return meta


def check_meta(path: Path, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Name the setting that differs between the checkpoint and this run."""
    settings = {"model": "--model / the plan's [model]", "data": "--data", "optimizer": "--optimizer",
                "seq_len": "--seq-len / layout.seq_len"}
    for key, setting in settings.items():
        if saved.get(key) != expected.get(key):
            raise MedleyInputError(
                f"checkpoint {path} was written with {key} = {saved.get(key)!r} but this run has "
                f"{expected.get(key)!r}; change {setting} to match, or use another --checkpoint-dir")


def load_checkpoint(path: Path, *, stages: dict[int, ShardedStage], expected: dict[str, Any]) -> int:
    """Collective: fill this rank's stages and optimizers from ``path``; returns the next step."""
    check_meta(path, read_meta(path), expected)
    state = checkpoint_state(stages, for_load=True)
    try:
        dcp.load(state, storage_reader=SafeReader(path))
    except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure (a BaseException)
        first = str(err).strip().splitlines()
        reason = next((line for line in first if "Error" in line), first[0] if first else type(err).__name__)
        raise MedleyInputError(
            f"checkpoint {path} is corrupt or does not match this model ({reason.strip()[:300]}); "
            "delete it to resume from the one before, or use another --checkpoint-dir") from None
    for stage in stages.values():
        stage.refresh_gathered()
    torch.set_rng_state(state["train.rng"])
    return int(state["train.next_step"])
