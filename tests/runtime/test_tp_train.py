"""Training with tensor parallelism (gloo, CPU): a tied-embedding model on tp2 x pp2 and the tiny
model on tp2 x dp2 train (and evaluate) as one process (AdamW, clipping active: the global norm
counts TP shards once each and replicated parameters once), the first's checkpoint resumes under tp1 and its
Hugging Face export starts a tp2 run, and ``medley train`` runs a plan file with
tp per stage on dp x sum(tp) ranks (and says so when given another count).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from launch_plans import cluster_file, node_toml, plan_file
from launch_plans import tiny_plan as node_plan
from train_plans import config, tied_tiny, tp_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.launch.spawn import train_local
from medley.runtime.checkpoint_layout import checkpoint_path, latest_checkpoint
from medley.runtime.hf_export import export_hf
from medley.runtime.reference import reference_losses, reference_run

TOL = 1e-5
# tp2 on both pipeline ranks, the embedding and its tied head copy on TP groups, ZeRO 0 then 3.
PLAN_TP = dict(tp=(2, 2), split="3,3", zero="0,3", schedule="1f1b", micro_batches="4", model=tied_tiny())
# The same model and global batch on one rank: the checkpoint's TP shards are read whole.
PLAN_ONE = dict(tp=(1,), split="6", zero="0", schedule="1f1b", micro_batches="4", model=tied_tiny())


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> tuple[Path, list]:
    """PLAN_TP, four steps, a checkpoint every two."""
    directory = tmp_path_factory.mktemp("ckpt_tp")
    records = train_local(tp_plan(**PLAN_TP), config(steps=4, checkpoint_dir=directory, measure_memory=False))
    return directory, records


@pytest.mark.timeout(240)
def test_tp2_x_pp2_trains_as_one_process(tp_run) -> None:
    _, records = tp_run
    want = reference_losses(tp_plan(**PLAN_TP).layout, config(steps=4))
    assert [r.step for r in records] == list(range(4))
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    assert all(r.grad_norm > 1.0 for r in records[:2]), "clipping must be active in this test"
    assert sorted((e.pipeline_rank, e.tp_rank) for e in records.placement) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", [dict(tp=(2,), dp=2, split="6", micro_batches="3,1"),
                                   dict(tp=(2, 2), dp=1, split="3,3", micro_batches="4")],
                         ids=["tp2xdp2", "tp2xpp2"])
def test_tp2_trains_and_evaluates_as_one_process(shape: dict, tmp_path) -> None:
    """tp2 x dp2: ZeRO-1 over the replicas of each TP rank, replicas with 3 and 1 micro-batches;
    tp2 x pp2: the pipeline hop scattered (each TP rank sends its slice, the next group gathers).
    Clipping on; the validation loss (forward only) after the last step too."""
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 20_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 256, 2_000, dtype=np.uint16).tofile(tmp_path / "val.bin")
    settings = dict(data=str(tmp_path / "train.bin"), val_data=str(tmp_path / "val.bin"), eval_every=3,
                    steps=3, checkpoint_every=0, measure_memory=False, clip_norm=0.5)
    plan = tp_plan(zero="1", schedule="1f1b", **shape)
    records = train_local(plan, config(**settings))
    want = reference_run(plan.layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    assert abs(records[-1].eval_loss - want.eval_losses[2]) <= TOL
    assert all(r.grad_norm > 0.5 for r in records), "clipping must be active in this test"


@pytest.mark.timeout(240)
def test_a_tp2_checkpoint_resumes_under_tp1(tp_run, tmp_path) -> None:
    """Steps 2-3 from the step-2 checkpoint of tp2 x pp2 on one rank: the same losses and
    gradient norms (each a global sum: a norm counted per TP rank would differ)."""
    directory, uninterrupted = tp_run
    resumed_dir = tmp_path / "ckpt"
    shutil.copytree(directory, resumed_dir)
    shutil.rmtree(checkpoint_path(resumed_dir, 4))
    records = train_local(tp_plan(**PLAN_ONE), config(steps=4, checkpoint_dir=resumed_dir,
                                                      measure_memory=False))
    assert [r.step for r in records] == [2, 3]
    for got, want in zip(records, uninterrupted[2:], strict=True):
        assert abs(got.loss - want.loss) <= TOL and abs(got.grad_norm - want.grad_norm) <= TOL


@pytest.mark.timeout(240)
def test_tp2_starts_from_hugging_face_weights(tp_run, tmp_path) -> None:
    """The tp run's last checkpoint exported as a Hugging Face directory and read by a tp2 ZeRO-1
    run (each TP rank reads whole layers, then keeps its slice): the reference's losses from the
    same weights, which are not the seeded ones."""
    directory, _ = tp_run
    hf = export_hf(latest_checkpoint(directory), tmp_path / "hf")
    plan = tp_plan(tp=(2,), split="6", zero="1", schedule="1f1b", micro_batches="4", model=tied_tiny())
    run = config(steps=2, init_from=hf, checkpoint_every=0, measure_memory=False)
    records = train_local(plan, run)
    want = reference_losses(plan.layout, run)
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    seeded = reference_losses(plan.layout, config(steps=1))
    assert abs(records[0].loss - seeded[0]) > 1e-3, "the run must start from the exported weights"


@pytest.mark.timeout(240)
def test_medley_train_runs_a_plan_file_with_tp(tmp_path: Path) -> None:
    """Pipeline rank 0 on devices 2, 3 (tp2), pipeline rank 1 on device 0: three ranks."""
    plan = node_plan(cluster_file(tmp_path, node_toml("four", 4)), pp=2, dp=1, assignment=((2, 0),),
                     split="2,2", zero="1,0", tp=(2, 1))
    fp32 = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, dtype="fp32"))  # what CPUs run
    path = plan_file(tmp_path, fp32)
    wrong = CliRunner().invoke(app, ["train", "--plan", str(path), "--local-ranks", "4", "--steps", "1"])
    assert wrong.exit_code == 2
    said = " ".join(wrong.output.split())
    assert "the plan needs dp 1 x (tp 2 + 1) = 3 ranks; pass --local-ranks 3" in said, said
    result = CliRunner().invoke(app, ["train", "--plan", str(path), "--local-ranks", "3", "--steps", "2",
                                      "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout[result.stdout.index("{"):])
    assert [(e["device"], e["pipeline_rank"], e["tp_rank"], e["stages"]) for e in out["placement"]] == [
        (0, 1, 0, [1]), (2, 0, 0, [0]), (3, 0, 1, [0])]
    assert sorted(out["records"][0]["peak_memory_bytes"]) == ["0", "2", "3"]  # the CPU probe, per device


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", ["0,0", "1,3"], ids=["zero0", "zero1,3"])
def test_sequence_parallel_tp2_x_pp2_trains_and_evaluates_as_one_process(zero: str, tmp_path) -> None:
    """``layout.sequence_parallel`` through ``medley train``'s path: tp2 x pp2, the hop carrying
    sequence shards, AdamW with clipping on (the norms' partial gradients summed over TP before
    the global norm: ZeRO-0 by medley, ZeRO-1/3 by FSDP2), and the validation loss."""
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 20_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 256, 2_000, dtype=np.uint16).tofile(tmp_path / "val.bin")
    settings = dict(data=str(tmp_path / "train.bin"), val_data=str(tmp_path / "val.bin"), eval_every=3,
                    steps=3, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=3, measure_memory=False,
                    clip_norm=0.5)
    base = tp_plan(tp=(2, 2), split="3,3", zero=zero, schedule="1f1b", micro_batches="4")
    plan = dataclasses.replace(base, layout=dataclasses.replace(base.layout, sequence_parallel=True))
    records = train_local(plan, config(**settings))
    want = reference_run(plan.layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    assert abs(records[-1].eval_loss - want.eval_losses[2]) <= TOL
    assert all(r.grad_norm > 0.5 for r in records), "clipping must be active in this test"
    assert latest_checkpoint(tmp_path / "ckpt") is not None
