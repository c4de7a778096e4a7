"""Hypothesis fuzz of checkpoint metadata (issue 26): one field of a real tiny checkpoint's
``.metadata`` pickle (its entries, storage locations, chunks, attributes; the pickle's hash then
rewritten in medley.json, as an attacker would) or of its ``medley.json`` is replaced, deleted or
added to, and the step resumed. Every example ends in one :class:`MedleyInputError` line or in a
load whose tensors equal the saved ones bit for bit (everything is zeroed before each load, so a
tensor left unread shows), never in another exception; a bytes entry's payload never runs.

The checkpoint, the rank's stages and the reference tensors are built once per module; an
example copies the step (3 MB) and loads it in-process (one gloo rank), about 0.05 s.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from train_plans import config, tiny_plan

from medley.errors import MedleyInputError
from medley.runtime import checkpoint
from medley.runtime.checkpoint_layout import META_FILE, checkpoint_path
from medley.runtime.optim import optimizer_class
from medley.runtime.setup import build_rank
from medley.runtime.train import train

PLAN = dict(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2")
STEP2 = checkpoint_path(Path(), 2).name
# More than the 12 of the input-file fuzz: a load is cheap (both tests about 9 s on 2 idle cores;
# MEDLEY_FUZZ_EXAMPLES=500: a longer, randomised hunt).
EXAMPLES = max(100, int(os.environ.get("MEDLEY_FUZZ_EXAMPLES", "100")))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    derandomize="MEDLEY_FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

VALUES = st.sampled_from([
    None, 0, -1, 1, 7, 3.5, True, "", "x", "__0_0.distcp", "../__0_0.distcp", "/etc/passwd", ".metadata",
    "medley.json", "__1_0.distcp", 2**63, -(2**40), [], [1], [256, 64], {}, {"a": 1}, (1, 2), b"\x00",
    float("nan"), torch.Size([]), torch.Size([1]), torch.Size([256, 64]), torch.Size([0, 0]), torch.float16,
    torch.int64])


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (eval, (f"open({str(self.marker)!r}, 'w').close() or __import__('torch').get_rng_state()",))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trained step, this rank's stages and what a correct load gives."""
    store = tmp_path_factory.mktemp("store")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    directory = tmp_path_factory.mktemp("trained") / "ckpt"
    train(tiny_plan(**PLAN), config(steps=2, checkpoint_dir=directory, measure_memory=False))
    opt_class, opt_kwargs = optimizer_class("adamw", lr=1e-3, weight_decay=0.0)
    setup = build_rank(tiny_plan(**PLAN), seed=0, optimizer_class=opt_class, optimizer_kwargs=opt_kwargs,
                       clip_grad=False, slowdown=None)
    step = directory / STEP2
    meta = json.loads((step / META_FILE).read_text())
    expected = {k: v for k, v in meta.items() if k not in ("format", "next_step", "files", "entries")}
    world = {"step": step, "stages": setup.stages, "expected": expected,
             "base": tmp_path_factory.mktemp("examples")}
    world["reference"] = _load(world, step)
    assert world["reference"] is not None
    yield world
    dist.destroy_process_group()


def _load(world: dict[str, Any], step: Path) -> dict[str, torch.Tensor] | None:
    """Load ``step`` into the zeroed stages: every tensor loaded (None: refused with one line)."""
    stages = world["stages"]
    for value in checkpoint.checkpoint_state(stages, for_load=True).values():
        value.zero_()
    skipped = torch.zeros((), dtype=torch.int64)
    torch.manual_seed(12345)
    try:
        start, _ = checkpoint.load_checkpoint(step, stages=stages, expected=world["expected"],
                                              train_state={"skipped_steps": skipped})
    except MedleyInputError as err:
        assert "\n" not in str(err) and str(err).startswith("checkpoint "), str(err)
        return None
    state = {key: value.clone() for key, value in checkpoint.checkpoint_state(stages, for_load=False).items()}
    state.update({"train.next_step": torch.tensor(start), "train.rng": torch.get_rng_state(),
                  "train.skipped_steps": skipped})
    return state


def _copy(world: dict[str, Any]) -> Path:
    root = Path(tempfile.mkdtemp(dir=world["base"]))
    return Path(shutil.copytree(world["step"], root / "ckpt" / STEP2))


def _check(world: dict[str, Any], step: Path, marker: Path) -> None:
    loaded = _load(world, step)
    assert not marker.exists(), "a checkpoint ran code"
    if loaded is not None:
        reference = world["reference"]
        assert loaded.keys() == reference.keys()
        wrong = [k for k in reference if not torch.equal(loaded[k], reference[k])]
        assert not wrong, f"loaded without an error but {wrong[:3]} differ"
    shutil.rmtree(step.parents[1], ignore_errors=True)


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclasses too (the attacker writes the pickle)


def _mutate_metadata(metadata: Any, op: str, key: str, value: object, payload: Path, inside: bool) -> None:
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    indexes = [i for i in storage if i.fqn == key]
    if op == "bytes":
        entries[key] = BytesStorageMetadata()
        for index in indexes:
            del storage[index]
        storage[MetadataIndex(key)] = _StorageInfo(
            relative_path=payload.name if inside else f"../../{payload.name}", offset=0,
            length=payload.stat().st_size)
    elif op == "delete_entry":
        del entries[key]
    elif op == "delete_storage":
        del storage[indexes[0]]
    elif op == "add_entry":
        entries[f"{key}.copy"] = copy.deepcopy(entries[key])
        storage[MetadataIndex(f"{key}.copy", indexes[0].offset)] = storage[indexes[0]]
    elif op in ("relative_path", "offset", "length", "transform_descriptors"):
        _set(storage[indexes[0]], op, value)
    elif op == "dtype":
        _set(entries[key].properties, "dtype", value)
    elif op in ("size", "chunks"):
        _set(entries[key], op, value)
    elif op in ("chunk_offsets", "chunk_sizes"):
        _set(entries[key].chunks[0], op.split("_")[1], value)
    elif op == "index_offset":
        offset = value if isinstance(value, torch.Size) else None
        storage[MetadataIndex(key, offset)] = storage.pop(indexes[0])
    else:  # a Metadata attribute
        _set(metadata, op, value)


METADATA_OPS = ["bytes", "delete_entry", "delete_storage", "add_entry", "relative_path", "offset", "length",
                "transform_descriptors", "dtype", "size", "chunks", "chunk_offsets", "chunk_sizes",
                "index_offset", "state_dict_metadata", "storage_data", "planner_data", "storage_meta",
                "version"]


@pytest.mark.timeout(600)
def test_mutated_checkpoint_metadata(world: dict[str, Any]) -> None:
    keys = sorted(json.loads((world["step"] / META_FILE).read_text())["entries"])

    @SETTINGS
    @given(op=st.sampled_from(METADATA_OPS), key=st.sampled_from(keys), value=VALUES, inside=st.booleans())
    # What a random hunt found: a None offset (dropped from the pickle by _StorageInfo.__getstate__,
    # AttributeError) and a list as dtype (unhashable, TypeError); and the probe's two payloads.
    @example(op="offset", key="model.head.out.weight", value=None, inside=True)
    @example(op="dtype", key="model.head.out.weight", value=[], inside=True)
    @example(op="bytes", key="train.rng", value=None, inside=True)
    @example(op="bytes", key="train.rng", value=None, inside=False)
    def run(op: str, key: str, value: object, inside: bool) -> None:
        step = _copy(world)
        marker = step.parents[1] / "marker"
        payload = (step if inside else step.parents[1]) / "payload.bin"
        buffer = io.BytesIO()
        torch.save(_Payload(marker), buffer)
        payload.write_bytes(buffer.getvalue())
        with open(step / ".metadata", "rb") as handle:
            metadata = pickle.load(handle)  # the test's own file: read unrestricted to edit it
        _mutate_metadata(metadata, op, key, value, payload, inside)
        try:
            data = pickle.dumps(metadata)
        except (TypeError, pickle.PicklingError, AttributeError):
            return  # a value pickle cannot hold: nothing to load
        (step / ".metadata").write_bytes(data)
        meta = json.loads((step / META_FILE).read_text())
        meta["files"][".metadata"] = checkpoint.sha256_of(step / ".metadata")
        (step / META_FILE).write_text(json.dumps(meta))
        _check(world, step, marker)

    run()


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*prefix, i))
    return out


JSON_VALUES = st.sampled_from([None, 0, -1, 1, 3, 2.5, True, "", "x", "float16", "tensor", "bytes", [], [1],
                               [256, 64], {}, {"a": 1}, "../__0_0.distcp", "0" * 64, 10**20])


@pytest.mark.timeout(600)
def test_mutated_medley_json(world: dict[str, Any]) -> None:
    original = json.loads((world["step"] / META_FILE).read_text())
    paths = sorted(_paths(original), key=repr)

    @SETTINGS
    @given(path=st.sampled_from(paths), op=st.sampled_from(["replace", "delete", "extra"]), value=JSON_VALUES)
    def run(path: tuple, op: str, value: object) -> None:
        step = _copy(world)
        meta = copy.deepcopy(original)
        parent = meta
        for part in path[:-1]:
            parent = parent[part]
        last = path[-1]
        if op == "replace":
            parent[last] = value
        elif op == "delete":
            del parent[last]
        elif isinstance(parent[last], dict):
            parent[last]["extra_key" if not path or path[0] != "files" else "extra.distcp"] = value
        else:
            parent[last] = [parent[last], value]
        (step / META_FILE).write_text(json.dumps(meta))
        _check(world, step, step.parents[1] / "marker")

    run()
