"""Nothing medley writes or removes follows a symbolic link (issue 26, finding 3, and the export
part of 9): a ``.medley.lock`` linked to another file, a ``step-N`` / ``.tmp-*`` / ``.old-*`` link
in a checkpoint directory, an export target or temporary that is a link, the atomic writers; and
a full disk under ``medley export`` or while ``medley.json`` is written is one line."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from train_plans import config, tiny_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.errors import MedleyInputError
from medley.fileio import UnsafePathError, append_text, remove_path, write_atomically, write_new_file
from medley.hf import write as hf_write
from medley.runtime import checkpoint, hf_export, lock
from medley.runtime.checkpoint_layout import META_FILE, checkpoint_path
from medley.runtime.config import check_config
from medley.runtime.train import train

PLAN = dict(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2")
STEP2, STEP4 = checkpoint_path(Path(), 2).name, checkpoint_path(Path(), 4).name
PRECIOUS = "the user's file, which no checkpoint directory may change\n"


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
    (directory / lock.LOCK_FILE).unlink()
    return directory


@pytest.fixture
def saved(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "ckpt"))


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A file outside every directory medley is given."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


def _run(directory: Path, steps: int = 4) -> list:
    return train(tiny_plan(**PLAN), config(steps=steps, checkpoint_dir=directory, measure_memory=False,
                                           extend_schedule=True))


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_linked_lock_file_is_refused_and_its_target_unchanged(tmp_path: Path, precious: Path,
                                                                 kind: str) -> None:
    """The probe's received directory: ``.medley.lock`` a link to another file (it was truncated
    and overwritten with the run's host and pid)."""
    directory = tmp_path / "received"
    directory.mkdir()
    link = directory / lock.LOCK_FILE
    os.symlink(precious, link) if kind == "symlink" else os.link(precious, link)
    what = "is a symbolic link" if kind == "symlink" else "has other hard links"
    with pytest.raises(MedleyInputError, match=rf"--checkpoint-dir {directory}: {link} {what}.*delete "
                                               rf"{link}"):
        lock.acquire(directory)
    assert precious.read_text() == PRECIOUS
    link.unlink()
    lock.acquire(directory).release()  # once the link is gone the directory is usable


def test_a_lock_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / lock.LOCK_FILE)
    with pytest.raises(MedleyInputError, match="is not a regular file"):
        lock.acquire(tmp_path)


@pytest.mark.timeout(120)
def test_training_into_a_directory_with_a_linked_lock_is_refused(group, tmp_path: Path,
                                                                 precious: Path) -> None:
    directory = tmp_path / "received"
    directory.mkdir()
    os.symlink(precious, directory / lock.LOCK_FILE)
    with pytest.raises(MedleyInputError, match=r"\.medley\.lock is a symbolic link"):
        _run(directory)
    assert precious.read_text() == PRECIOUS


@pytest.mark.timeout(120)
def test_a_step_directory_that_is_a_link_is_refused(saved: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside-step"
    (saved / STEP2).rename(outside)
    os.symlink(outside, saved / STEP2)
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(MedleyInputError, match=rf"checkpoint {saved / STEP2}: is a symbolic link; medley "
                                               "reads and writes checkpoints only inside --checkpoint-dir"):
        _run(saved)
    assert sorted(p.name for p in outside.iterdir()) == before


@pytest.mark.timeout(120)
def test_leftover_tmp_and_old_links_are_removed_as_links(saved: Path, tmp_path: Path, precious: Path) -> None:
    """``.tmp-step-N`` and ``.old-*`` links to a directory outside: the save removes the links
    (``rmtree`` refused them silently, then ``mkdir`` failed), never what they point to."""
    outside = precious.parent
    os.symlink(outside, saved / f".tmp-{STEP4}")
    os.symlink(outside, saved / f".old-{STEP2}")
    os.symlink(precious, saved / ".old-step-00000001")
    assert [r.step for r in _run(saved)] == [2, 3]
    assert precious.read_text() == PRECIOUS and sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    assert sorted(p.name for p in saved.iterdir()) == [lock.LOCK_FILE, STEP2, STEP4]
    assert not (saved / STEP4).is_symlink()


def test_remove_path_removes_a_link_not_its_target(tmp_path: Path, precious: Path) -> None:
    for target in (precious, precious.parent):
        os.symlink(target, tmp_path / "link")
        remove_path(tmp_path / "link")
        assert not os.path.lexists(tmp_path / "link")
    tree = tmp_path / "tree"
    tree.mkdir()
    os.symlink(precious.parent, tree / "inner")
    remove_path(tree)
    assert not tree.exists() and precious.read_text() == PRECIOUS


def test_the_writers_never_write_through_a_link(tmp_path: Path, precious: Path) -> None:
    link = tmp_path / "out.json"
    os.symlink(precious, link)
    write_atomically(link, "{}")  # plan files, traces, Gantt charts, JSON reports: the link is replaced
    assert precious.read_text() == PRECIOUS and not link.is_symlink() and link.read_text() == "{}"
    os.symlink(precious, tmp_path / "log.jsonl")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        append_text(tmp_path / "log.jsonl", "{}\n")
    with pytest.raises(FileExistsError):
        write_new_file(tmp_path / "log.jsonl", "x")
    assert precious.read_text() == PRECIOUS


def test_a_linked_log_jsonl_is_refused_before_training(tmp_path: Path, precious: Path) -> None:
    os.symlink(precious, tmp_path / "log.jsonl")
    os.link(precious, tmp_path / "hard.jsonl")
    for name, what in (("log.jsonl", "is a symbolic link"), ("hard.jsonl", "has other hard links")):
        with pytest.raises(MedleyInputError, match=f"--log-jsonl .*{name}: {what}.*path of a regular"):
            check_config(config(log_jsonl=tmp_path / name))
    check_config(config(log_jsonl=tmp_path / "new.jsonl"))  # a new file, or a regular one, is fine
    assert precious.read_text() == PRECIOUS and not (tmp_path / "new.jsonl").exists()


@pytest.mark.timeout(120)
def test_export_never_writes_through_a_link(saved: Path, tmp_path: Path, precious: Path) -> None:
    step = saved / STEP2
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(MedleyInputError, match="already exists; give a new directory"):
        hf_export.export_hf(step, dangling)
    assert not (tmp_path / "nowhere").exists()
    out = tmp_path / "hf"
    os.symlink(precious.parent, tmp_path / f".tmp-hf-{os.getpid()}")  # the export's own temporary name
    hf_export.export_hf(step, out)
    assert (out / "model.safetensors").is_file() and not out.is_symlink()
    assert sorted(p.name for p in precious.parent.iterdir()) == ["precious.txt"]
    assert precious.read_text() == PRECIOUS


def _full_disk(real):  # noqa: ANN001, ANN202
    def write(path: Path, data: bytes | str) -> None:
        if Path(path).name.endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)
    return write


@pytest.mark.timeout(120)
def test_export_to_a_full_disk_is_one_line(saved: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """It exited 1 with safetensors' SafetensorError; now the shard is written by medley's
    writer, whose OSError names the file and the free space."""
    monkeypatch.setattr(hf_write, "write_new_file", _full_disk(hf_write.write_new_file))
    result = CliRunner(env={"COLUMNS": "1000"}).invoke(app, ["export", str(saved / STEP2), "--hf",
                                                              str(tmp_path / "hf")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"{tmp_path / 'hf'}: cannot write (No space left on device, " in lines[0]
    assert "MiB free); free some space or choose another location." in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left


@pytest.mark.timeout(120)
def test_a_full_disk_while_medley_json_is_written_is_one_line(saved: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = checkpoint.open_no_follow

    def full(path: Path, flags: int, mode: int = 0o644) -> int:
        if Path(path).name == META_FILE:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, flags, mode)

    monkeypatch.setattr(checkpoint, "open_no_follow", full)
    with pytest.raises(MedleyInputError, match=r"^checkpoint .*\.tmp-step-00000004: cannot write \(No space "
                                               r"left on device, .* MiB free\)") as err:
        _run(saved)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in saved.iterdir()) == [lock.LOCK_FILE, STEP2]
