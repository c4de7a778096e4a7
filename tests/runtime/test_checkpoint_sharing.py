"""Checkpoints across nodes: every rank proves at start that it sees the checkpoint directory
rank 0 locked (the random token of its lock file), so a node-local --checkpoint-dir on several
machines is one line on every rank instead of broken checkpoints; ``--keep N`` keeps the N newest.

Two nodes with node-local directories are emulated by giving rank 1 another directory under the
same name: what it would see on its own disk (nothing, or a stale lock of an earlier run)."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from train_plans import config, tiny_plan

from medley.errors import MedleyInputError
from medley.launch.nodes import free_port
from medley.launch.spawn import train_local
from medley.runtime import checkpoint, lock
from medley.runtime.train import check_config


def worker(rank: int, port: int, directories: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    directory = Path(directories[rank])
    held = lock.acquire(directory) if rank == 0 else None
    try:
        checkpoint.check_shared(directory, None if held is None else held.token)
        result = "ok"
    except MedleyInputError as err:
        result = str(err)
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(tmp_path: Path, directories: list[Path]) -> list[str]:
    multiprocessing.set_forkserver_preload(["torch"])
    out = str(tmp_path / "result")
    mp.start_processes(worker, args=(free_port(), [str(d) for d in directories], out), nprocs=2, join=True,
                       start_method="forkserver")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


@pytest.mark.timeout(120)
def test_ranks_that_share_the_directory_pass(tmp_path: Path) -> None:
    assert _run(tmp_path, [tmp_path / "ckpt", tmp_path / "ckpt"]) == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_a_node_local_directory_is_one_line_on_every_rank(tmp_path: Path) -> None:
    local = tmp_path / "node1-disk"
    local.mkdir()
    (local / lock.LOCK_FILE).write_text(json.dumps({"host": "x", "pid": 1, "token": "an earlier run"}))
    results = _run(tmp_path, [tmp_path / "ckpt", local])
    assert results[0] == results[1]
    assert f"rank 1 (on {socket.gethostname()}) do not see the lock file rank 0 wrote there" in results[0]
    assert "give a --checkpoint-dir on a shared file system" in results[0]


@pytest.mark.timeout(300)
def test_keep_n_keeps_the_newest_n(tmp_path: Path) -> None:
    with pytest.raises(MedleyInputError, match="--keep 0: keep at least 1 checkpoint"):
        check_config(config(checkpoint_dir=tmp_path / "x", keep=0))
    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="0,0", schedule="1f1b", micro_batches="2")
    train_local(plan, config(steps=5, checkpoint_every=1, keep=3,
                             checkpoint_dir=tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == \
        ["step-00000003", "step-00000004", "step-00000005"]
