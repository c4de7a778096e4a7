"""A checkpoint loads exactly the tensors medley wrote (issue 26, findings 1, 10 and the export
part of 15): a bytes entry never runs its payload, inside or outside the step directory; no entry
is read from outside it or from an unhashed file; medley.json's entries and model must match the
model that loads them; an empty file list is refused. Each input is the one the hostile probe
used. One tiny checkpoint is trained once per module; each test edits a copy."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from train_plans import config, tiny_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.errors import MedleyInputError
from medley.runtime import checkpoint
from medley.runtime.checkpoint_layout import META_FILE, checkpoint_path
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.hf_export import export_hf
from medley.runtime.train import train
from medley.spec.model_arg import get_model

PLAN = dict(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2")
STEP2 = checkpoint_path(Path(), 2).name


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("store")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(group, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("trained") / "ckpt"
    train(tiny_plan(**PLAN), config(steps=2, checkpoint_dir=directory, measure_memory=False))
    return directory


@pytest.fixture
def saved(trained: Path, tmp_path: Path) -> Path:
    """A fresh copy of the checkpoint directory (step 2 in it)."""
    return Path(shutil.copytree(trained, tmp_path / "ckpt"))


def _resume(directory: Path, **plan: object) -> list:
    settings = config(steps=3, checkpoint_dir=directory, measure_memory=False, extend_schedule=True)
    return train(tiny_plan(**{**PLAN, **plan}), settings)


def _metadata(step: Path):  # noqa: ANN202 - DCP Metadata, read without medley's checks (test input)
    with open(step / ".metadata", "rb") as handle:
        return pickle.load(handle)


def _write_metadata(step: Path, metadata: object) -> None:
    """What an attacker who edits ``.metadata`` would also do: record its new hash in medley.json."""
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(step, ".metadata")


def _rehash(step: Path, name: str) -> None:
    _edit_meta(step, lambda meta: meta["files"].__setitem__(name, checkpoint.sha256_of(step / name)))


def _edit_meta(step: Path, edit) -> None:  # noqa: ANN001
    meta = json.loads((step / META_FILE).read_text())
    edit(meta)
    (step / META_FILE).write_text(json.dumps(meta))


class _Payload:
    """Unpickled by ``torch.load(weights_only=False)``, it creates ``marker`` (and returns a valid
    RNG state, so that a resume that runs it trains on as if nothing happened)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (eval, (f"open({str(self.marker)!r}, 'w').close() or __import__('torch').get_rng_state()",))


def _bytes_entry(step: Path, marker: Path, relative_path: str) -> Path:
    """The probe's checkpoint: ``train.rng`` turned into a bytes entry whose storage is a
    ``torch.save`` of a payload at ``relative_path`` (from the step directory)."""
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    target = (step / relative_path).resolve()
    target.write_bytes(payload.getvalue())
    metadata = _metadata(step)
    metadata.state_dict_metadata["train.rng"] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == "train.rng"]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex("train.rng")] = _StorageInfo(
        relative_path=relative_path, offset=0, length=len(payload.getvalue()))
    _write_metadata(step, metadata)
    return target


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relative_path", ["payload.bin", "../../payload.bin"])
def test_a_bytes_entry_is_refused_and_its_payload_never_runs(saved: Path, tmp_path: Path,
                                                             relative_path: str) -> None:
    step = saved / STEP2
    proof, marker = tmp_path / "proof", tmp_path / "marker"
    _bytes_entry(step, proof, relative_path)
    stock = {"train.rng": torch.empty(0, dtype=torch.uint8)}
    dcp.load(stock, storage_reader=FileSystemReader(step), no_dist=True)  # DCP as it comes: the payload runs
    assert proof.exists(), "the crafted checkpoint must run its payload when DCP loads it unguarded"
    _bytes_entry(step, marker, relative_path)
    with pytest.raises(MedleyInputError) as err:
        _resume(saved)
    message = str(err.value)
    assert f"{step / '.metadata'}: entry 'train.rng' is BytesStorageMetadata, not a tensor" in message
    assert f"delete {step} to resume from the checkpoint before it" in message and "\n" not in message
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="'train.rng' is BytesStorageMetadata"):
        SafeReader(step).read_metadata()  # refused wherever the reader is used
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_a_tensor_stored_outside_the_step_directory_is_refused(saved: Path) -> None:
    """A tensor entry whose relative_path escapes the directory (to an exact copy of the shard, so
    that only the path is wrong)."""
    step = saved / STEP2
    shutil.copy(step / "__0_0.distcp", saved.parent / "__0_0.distcp")
    metadata = _metadata(step)
    index = next(i for i in metadata.storage_data if i.fqn == "model.head.out.weight")
    metadata.storage_data[index].relative_path = "../../__0_0.distcp"
    _write_metadata(step, metadata)
    with pytest.raises(MedleyInputError, match=r"\.metadata: entry 'model.head.out.weight' is stored in "
                                               r"'\.\./\.\./__0_0\.distcp', which is not a DCP data file of "
                                               r"the step directory"):
        _resume(saved)


@pytest.mark.timeout(120)
def test_a_tensor_in_an_unhashed_file_is_refused(saved: Path) -> None:
    step = saved / STEP2
    shutil.copy(step / "__0_0.distcp", step / "__0_1.distcp")
    metadata = _metadata(step)
    index = next(i for i in metadata.storage_data if i.fqn == "model.head.out.weight")
    metadata.storage_data[index].relative_path = "__0_1.distcp"
    _write_metadata(step, metadata)
    with pytest.raises(MedleyInputError, match=r"'model.head.out.weight' is stored in __0_1\.distcp, which "
                                               r"medley\.json's file list does not cover \(no sha256\)"):
        _resume(saved)


def _add_entry(step: Path, metadata, meta) -> None:  # noqa: ANN001
    """A key neither the model nor the optimizer has, added to .metadata and medley.json alike,
    its tensor in a new data file with its hash listed."""
    data = io.BytesIO()
    torch.save(torch.zeros(256, 64), data)
    (step / "__0_1.distcp").write_bytes(data.getvalue())
    meta["files"]["__0_1.distcp"] = checkpoint.sha256_of(step / "__0_1.distcp")
    entry = metadata.state_dict_metadata["model.head.out.weight"]
    metadata.state_dict_metadata["model.blocks.9.extra"] = entry
    metadata.storage_data[MetadataIndex("model.blocks.9.extra", entry.chunks[0].offsets)] = _StorageInfo(
        relative_path="__0_1.distcp", offset=0, length=len(data.getvalue()))
    meta["entries"]["model.blocks.9.extra"] = meta["entries"]["model.head.out.weight"]


def _remove_entry(step: Path, metadata, meta) -> None:  # noqa: ANN001
    del metadata.state_dict_metadata["optim.head.out.weight.exp_avg"]
    for index in [i for i in metadata.storage_data if i.fqn == "optim.head.out.weight.exp_avg"]:
        del metadata.storage_data[index]
    del meta["entries"]["optim.head.out.weight.exp_avg"]


def _change_dtype(step: Path, metadata, meta) -> None:  # noqa: ANN001
    metadata.state_dict_metadata["model.head.out.weight"].properties.dtype = torch.float16
    meta["entries"]["model.head.out.weight"]["dtype"] = "float16"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("edit", "expected"), [
    (_add_entry, "has an entry 'model.blocks.9.extra' that this run does not have"),
    (_remove_entry, "has no entry 'optim.head.out.weight.exp_avg', which this run has"),
    (_change_dtype, "entry 'model.head.out.weight' is tensor float16 [256, 64] but tensor float32 [256, 64] "
                    "in this run")])
def test_entries_must_be_those_of_the_model_that_loads_them(saved: Path, edit, expected: str) -> None:  # noqa: ANN001
    """Added, removed or retyped consistently in .metadata and medley.json, every hash right:
    refused against the run's own tensors."""
    step = saved / STEP2
    metadata, meta = _metadata(step), json.loads((step / META_FILE).read_text())
    edit(step, metadata, meta)
    (step / META_FILE).write_text(json.dumps(meta))
    _write_metadata(step, metadata)
    with pytest.raises(MedleyInputError) as err:
        _resume(saved)
    assert expected in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.timeout(120)
def test_an_entry_only_in_one_of_metadata_and_medley_json_is_refused(saved: Path) -> None:
    step = saved / STEP2
    _edit_meta(step, lambda meta: meta["entries"].pop("train.skipped_steps"))
    with pytest.raises(MedleyInputError, match=r"entry 'train.skipped_steps' is tensor int64 \[\] in "
                                               r"\.metadata but absent in medley\.json"):
        _resume(saved)


@pytest.mark.timeout(120)
def test_lowered_num_blocks_is_refused_by_export_and_resume(saved: Path, tmp_path: Path) -> None:
    """The probe's edit: model.num_blocks 4 -> 3 in medley.json exported silently without block 3."""
    step = saved / STEP2
    _edit_meta(step, lambda meta: meta["model"].__setitem__("num_blocks", 3))
    with pytest.raises(MedleyInputError, match=r"has an entry 'model.blocks.3.attn.wk.weight' that the "
                                               r"model medley.json names \(3 blocks\) does not have.*; "
                                               r"export another step$"):
        export_hf(step, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(MedleyInputError, match="was written with model = .*'num_blocks': 3"):
        _resume(saved)  # the 4-block run
    three = dataclasses.replace(get_model("tiny"), num_blocks=3)
    with pytest.raises(MedleyInputError, match=r"has an entry 'model.blocks.3.attn.wk.weight' that this run "
                                               r"does not have"):
        _resume(saved, model=three, split="5")  # a 3-block run, as medley.json now claims


@pytest.mark.timeout(120)
def test_an_empty_file_list_is_refused_even_when_a_shard_changed(saved: Path, tmp_path: Path) -> None:
    """``"files": {}`` disabled every check: a flipped shard byte then resumed and exported."""
    step = saved / STEP2
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _edit_meta(step, lambda meta: meta.__setitem__("files", {}))
    pattern = r"medley\.json's \"files\" must give a sha256 for \.metadata and every data file"
    with pytest.raises(MedleyInputError, match=pattern):
        _resume(saved)
    with pytest.raises(MedleyInputError, match=pattern + ".*export another step"):
        export_hf(step, tmp_path / "hf")
    _edit_meta(step, lambda meta: meta.__setitem__("files", {}))
    _rehash(step, ".metadata")  # the list holds .metadata alone: the shard is not covered
    with pytest.raises(MedleyInputError, match=r"is stored in __0_0\.distcp, which medley\.json's file list "
                                               r"does not cover"):
        _resume(saved)


@pytest.mark.timeout(120)
def test_a_format_2_checkpoint_is_refused_naming_the_new_format(saved: Path) -> None:
    step = saved / STEP2
    _edit_meta(step, lambda meta: (meta.__setitem__("format", 2), meta.pop("entries")))
    with pytest.raises(MedleyInputError, match=r"medley\.json is format 2, not 3 \(format 3 lists every "
                                               r"tensor entry.*use it with the medley that wrote it"):
        _resume(saved)


def _one_line_exit_2(args: list[str]) -> str:
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_export_of_a_directory_that_is_no_step_names_the_right_fix(tmp_path: Path) -> None:
    """``medley export /`` said "delete the directory"."""
    line = _one_line_exit_2(["export", "/", "--hf", str(tmp_path / "out")])
    assert "checkpoint /: no medley.json, so this is not a medley checkpoint step; give a step" in line
    assert "delete" not in line
    line = _one_line_exit_2(["export", str(tmp_path), "--hf", "/"])
    assert "--hf /: already exists; give a new directory" in line and "delete" not in line
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_export_of_a_corrupt_medley_json_names_the_export_fix(saved: Path, tmp_path: Path) -> None:
    (saved / STEP2 / META_FILE).write_text("{")
    line = _one_line_exit_2(["export", str(saved / STEP2), "--hf", str(tmp_path / "out")])
    assert "medley.json: unreadable or not JSON" in line and line.endswith("export another step")
    assert "--checkpoint-dir" not in line and "delete" not in line
