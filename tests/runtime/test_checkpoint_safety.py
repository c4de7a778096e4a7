"""Checkpoints that cannot run code, cannot be damaged silently and never keep a diverged state
(issue #11, defects 2, 3, 5 and the checkpoint part of 7). One rank runs in-process."""

from __future__ import annotations

import errno
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from train_plans import config, tiny_plan

from medley.errors import MedleyInputError
from medley.runtime import checkpoint, lock
from medley.runtime.checkpoint_layout import META_FILE, checkpoint_path
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.train import train

PLAN = dict(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2")
STEP2 = checkpoint_path(Path(), 2).name


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def dotted_name_payload(marker: Path) -> bytes:
    """The issue's payload: a name in a torch.distributed.checkpoint module, resolved as a dotted
    path by protocol 4 (``filesystem.os.system``), called with a shell command."""
    return (b"\x80\x04" + _short("torch.distributed.checkpoint.filesystem") + _short("os.system") + b"\x93"
            + _short(f"touch {marker}") + b"\x85R.")


def getattr_payload(marker: Path) -> bytes:
    """``getattr(torch.distributed.checkpoint.filesystem.os, "system")("touch marker")``."""
    return (b"\x80\x04" + _short("builtins") + _short("getattr") + b"\x93"
            + _short("torch.distributed.checkpoint.filesystem") + _short("os") + b"\x93"
            + _short("system") + b"\x86R" + _short(f"touch {marker}") + b"\x85R.")


@pytest.mark.parametrize("payload", [dotted_name_payload, getattr_payload])
def test_metadata_payloads_are_refused_and_never_run(tmp_path: Path, payload) -> None:  # noqa: ANN001
    proof = tmp_path / "proof"
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())",
                    str(_write(tmp_path / "p1", payload(proof)))], check=True)
    assert proof.exists(), "the payload must run code when unpickled without restrictions"
    marker = tmp_path / "marker"
    (tmp_path / ".metadata").write_bytes(payload(marker))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata") as err:
        SafeReader(tmp_path).read_metadata()
    assert "\n" not in str(err.value)
    assert not marker.exists()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_truncated_metadata_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}, protocol=4)[:7])
    with pytest.raises(pickle.UnpicklingError, match="not readable DCP metadata") as err:
        SafeReader(tmp_path).read_metadata()
    assert "\n" not in str(err.value)


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def saved(one_rank_group, tmp_path: Path) -> Path:
    """A directory with the checkpoint after two steps."""
    directory = tmp_path / "ckpt"
    train(tiny_plan(**PLAN), config(steps=2, checkpoint_dir=directory, measure_memory=False))
    return directory


def _rehash(step: Path, name: str) -> None:
    """What an attacker who edits a file would also do: record its new hash in medley.json."""
    meta = json.loads((step / META_FILE).read_text())
    meta["files"][name] = checkpoint.sha256_of(step / name)
    (step / META_FILE).write_text(json.dumps(meta))


def _resume(directory: Path, **overrides: object) -> list:
    plan = overrides.pop("plan", tiny_plan(**PLAN))
    overrides.setdefault("extend_schedule", True)  # four steps from a two-step run's checkpoint
    return train(plan, config(steps=4, checkpoint_dir=directory, measure_memory=False, **overrides))


@pytest.mark.timeout(120)
def test_resume_never_runs_a_crafted_metadata_file(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    (saved / STEP2 / ".metadata").write_bytes(dotted_name_payload(marker))
    with pytest.raises(MedleyInputError, match="sha256"):
        _resume(saved)
    _rehash(saved / STEP2, ".metadata")
    with pytest.raises(MedleyInputError, match="os.system, which is not DCP metadata") as err:
        _resume(saved)
    assert "\n" not in str(err.value) and not marker.exists()


@pytest.mark.timeout(120)
def test_a_truncated_metadata_file_stops_the_resume_with_one_line(saved: Path) -> None:
    metadata = saved / STEP2 / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    _rehash(saved / STEP2, ".metadata")
    with pytest.raises(MedleyInputError, match="corrupt.*not readable DCP metadata") as err:
        _resume(saved)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(120)
def test_an_overwritten_tensor_is_caught_by_its_hash(saved: Path) -> None:
    """The issue's damage: one tensor's bytes overwritten in a .distcp shard (same size, so the
    structure still loads; it resumed with exit 0 and loss +0.22)."""
    step = saved / STEP2
    info = SafeReader(step).read_metadata().storage_data
    index = next(i for i in info if i.fqn == "model.blocks.0.attn.wq.weight")
    shard = step / info[index].relative_path
    data = bytearray(shard.read_bytes())
    middle = info[index].offset + info[index].length // 2
    data[middle:middle + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    with pytest.raises(MedleyInputError, match=f"{shard.name}: its content changed.*sha256") as err:
        _resume(saved)
    assert str(shard) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(120)
def test_a_deleted_medley_json_is_an_error_not_a_restart(saved: Path) -> None:
    step = saved / STEP2
    (step / META_FILE).unlink()
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    with pytest.raises(MedleyInputError, match=f"{step}: medley.json is missing; restore it, or delete"):
        _resume(saved)
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before  # nothing overwritten


@pytest.mark.timeout(120)
def test_resume_refuses_another_data_order_unless_reset(saved: Path, capsys) -> None:  # noqa: ANN001
    with pytest.raises(MedleyInputError, match=r"seed 3 -> 4.*--seed back, or pass --reset-data-order"):
        _resume(saved, seed=4)
    more = tiny_plan(**{**PLAN, "micro_batches": "3"})
    with pytest.raises(MedleyInputError, match="global_batch 4 -> 6"):
        _resume(saved, plan=more)
    records = _resume(saved, seed=4, reset_data_order=True)
    assert [r.step for r in records] == [2, 3]
    assert "seed 3 -> 4" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_diverged_run_keeps_its_good_checkpoints(one_rank_group, tmp_path: Path) -> None:
    """--lr 100 on tiny: the loss turns NaN after a few steps. The run stops at that step with one
    line, and the checkpoints it keeps are the last finite ones (with two kept, both were NaN)."""
    directory = tmp_path / "ckpt"
    with pytest.raises(MedleyInputError, match=r"^step \d+: loss .* diverged.*lower --lr \(now 100\)") as err:
        train(tiny_plan(**PLAN), config(steps=20, lr=100.0, checkpoint_dir=directory, measure_memory=False))
    assert "\n" not in str(err.value)
    diverged = int(str(err.value).split(":")[0].split()[1])
    kept = sorted(directory.glob("step-*"))
    assert 2 < diverged < 20 and len(kept) == 2 and int(kept[-1].name[5:]) <= diverged
    for step in kept:
        state = {"model.blocks.0.attn.wq.weight": torch.zeros(64, 64),
                 "model.head.out.weight": torch.zeros(256, 64)}
        dcp.load(state, storage_reader=SafeReader(step), no_dist=True)
        assert all(bool(torch.isfinite(t).all()) for t in state.values())


@pytest.mark.timeout(120)
def test_a_non_finite_state_is_never_saved(saved: Path) -> None:
    from medley.runtime.optim import optimizer_class
    from medley.runtime.setup import build_rank

    opt_class, opt_kwargs = optimizer_class("adamw", lr=1e-3, weight_decay=0.0)
    setup = build_rank(tiny_plan(**PLAN), seed=0, optimizer_class=opt_class, optimizer_kwargs=opt_kwargs,
                       clip_grad=False, slowdown=None)
    next(iter(setup.stages.values())).module.get_parameter("head.out.weight").data[0, 0] = float("nan")
    with pytest.raises(MedleyInputError, match="model.head.out.weight holds non-finite values"):
        checkpoint.CheckpointStore(directory=saved).save(next_step=4, stages=setup.stages, meta={})
    assert sorted(p.name for p in saved.iterdir() if not p.name.startswith(".medley")) == [STEP2]


class _FullDisk:
    """A writer that fails like a full disk on the second save."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.saves = error, 0

    def __call__(self, path: Path, **kwargs: object) -> dcp.FileSystemWriter:
        self.saves += 1
        writer = dcp.FileSystemWriter(path, **kwargs)
        if self.saves >= 2:
            def fail(*_args: object, **_kwargs: object) -> None:
                raise self.error
            writer.write_data = fail
        return writer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 704 vs 598")])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(
        one_rank_group, tmp_path: Path, monkeypatch, error: BaseException) -> None:  # noqa: ANN001
    monkeypatch.setattr(checkpoint, "FileSystemWriter", _FullDisk(error))
    directory = tmp_path / "ckpt"
    with pytest.raises(MedleyInputError, match=r"\.tmp-step-00000004: cannot write \(.*MiB free\)") as err:
        train(tiny_plan(**PLAN), config(steps=4, checkpoint_dir=directory, measure_memory=False))
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in directory.iterdir()) == [".medley.lock", STEP2]  # no temporary left
    monkeypatch.undo()
    assert [r.step for r in _resume(directory)] == [2, 3]  # the previous one is intact


def test_a_second_run_is_refused_while_the_holder_lives(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from medley.runtime import lock; "
         "held = lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(MedleyInputError, match=rf"another run \(pid {holder.pid} on .*\) is using it"):
            lock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock.acquire(tmp_path).release()  # the holder is gone: its stale lock is taken over


def test_a_stale_lock_file_from_a_dead_pid_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    (tmp_path / lock.LOCK_FILE).write_text(json.dumps({"host": "here", "pid": int(dead.stdout)}))
    held = lock.acquire(tmp_path)
    assert json.loads((tmp_path / lock.LOCK_FILE).read_text())["pid"] != int(dead.stdout)
    held.release()


@pytest.mark.timeout(120)
def test_training_into_a_locked_directory_is_refused(one_rank_group, tmp_path: Path) -> None:
    held = lock.acquire(tmp_path / "ckpt")
    try:
        with pytest.raises(MedleyInputError, match="another run"):
            _resume(tmp_path / "ckpt")
    finally:
        held.release()
