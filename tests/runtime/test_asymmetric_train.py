"""Replica groups of their own shape (:mod:`medley.plan.segments`) train equal to one process
(fp32, per-step losses and the final parameters of the saved checkpoint): unlike depths, splits,
schedules and micro-batch counts, every ZeRO level on the segments they share; and an asymmetric
plan's checkpoint resumes under alike replicas and back, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from train_plans import asymmetric_plan, config, reference_layout, tiny_plan

from medley.launch.spawn import train_local
from medley.plan.plan import Plan
from medley.runtime.checkpoint_layout import checkpoint_path
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.reference import reference_train
from medley.runtime.train import TrainHooks
from medley.runtime.transformer import Decoder

TOL = 1e-5
STEPS = 3


def saved_params(directory: Path, plan: Plan) -> dict[str, torch.Tensor]:
    """The whole model's parameters in the run's last checkpoint."""
    model = Decoder(plan.shared.model, seed=0)
    state = {f"model.{name}": param.detach().clone() for name, param in model.named_parameters()}
    dcp.load(state, storage_reader=SafeReader(checkpoint_path(directory, STEPS)), no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


def check_against_reference(plan: Plan, directory: Path, **overrides: object) -> None:
    records = train_local(plan, config(steps=STEPS, checkpoint_every=0, checkpoint_dir=directory,
                                       measure_memory=False, **overrides))
    model, want = reference_train(reference_layout(plan), config(steps=STEPS, **overrides))
    assert [r.step for r in records] == list(range(STEPS))
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    saved = saved_params(directory, plan)
    worst = max(float((saved[name] - param.detach()).abs().max()) for name, param in model.named_parameters())
    assert worst <= TOL


GROUPS = {
    # A pp 2 (split 2,4) + B pp 1, every ZeRO level; uneven micro-batch counts.
    **{f"pp2+pp1-zero{z}": (dict(pp=2, dp=1, split="2,4", zero=f"{z},{z}", schedule="1f1b",
                                 micro_batches="3"),
                            dict(pp=1, dp=1, split="6", zero=z, schedule="1f1b", micro_batches="2"))
       for z in "0123"},
    # A pp 2 (2,4) + B pp 2 (4,2): three segments, each rank of B in two of them.
    "pp2(2,4)+pp2(4,2)-zero2": (dict(pp=2, dp=1, split="2,4", zero="2,2", schedule="zb-h1",
                                     micro_batches="4"),
                                dict(pp=2, dp=1, split="4,2", zero="2,2", schedule="1f1b",
                                     micro_batches="2")),
    # A pp 3 + B pp 2 (two replicas) with ZeRO-3 on the segments, bucketed.
    "pp3+2xpp2-zero3": (dict(pp=3, dp=1, split="2,2,2", zero="3,3,3", schedule="1f1b", micro_batches="3",
                             buckets=2),
                        dict(pp=2, dp=2, split="3,3", zero="3,3", schedule="1f1b", micro_batches="2,1",
                             buckets=2)),
    # One replica interleaved (two chunks per rank), the other 1F1B.
    "interleaved+1f1b-zero1": (dict(pp=2, dp=1, split="1,2,2,1", zero="1,1,1,1", schedule="interleaved",
                                    virtual_stages=2, micro_batches="4"),
                               dict(pp=2, dp=1, split="3,3", zero="1,1", schedule="1f1b", micro_batches="2")),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_asymmetric_replicas_match_the_reference(name: str, tmp_path: Path) -> None:
    check_against_reference(asymmetric_plan(*GROUPS[name]), tmp_path / "ckpt")


@pytest.mark.timeout(300)
def test_an_fp16_overflow_on_one_replica_group_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """fp16 with loss scaling: an inf in the gradient of group B's only rank (global rank 2) at
    step 2 skips that step on all three ranks of both groups and halves the scale everywhere."""
    import functools

    from test_fp16 import INIT, seen, watch_and_inject

    plan = asymmetric_plan(*GROUPS["pp2+pp1-zero1"])
    hook = functools.partial(watch_and_inject, directory=str(tmp_path), inject_step=2, inject_rank="2",
                             inject_stage=0)
    records = train_local(plan, config(steps=4, dtype="fp16", checkpoint_every=0, measure_memory=False),
                          hooks=TrainHooks(grad_hook=hook))
    assert [r.skipped_steps for r in records] == [0, 0, 1, 1]
    assert [r.loss_scale for r in records] == [INIT, INIT, INIT, INIT / 2]
    ranks = seen(tmp_path)
    assert sorted(ranks) == ["rank0", "rank1", "rank2"]
    for rank, steps in ranks.items():
        assert [s["scale"] for s in steps] == [INIT, INIT, INIT, INIT / 2], rank
        assert [s["adam_steps"] for s in steps] == [0, 1, 2, 2], rank  # step 2 applied nothing
        assert steps[3]["weights"] == steps[2]["weights"] != steps[1]["weights"], rank


ASYMMETRIC = GROUPS["pp3+2xpp2-zero3"]  # 3 + 2 + 1 micro-batches
SYMMETRIC = dict(pp=2, dp=2, split="3,3", zero="1,1", schedule="zb-h1", micro_batches="4,2")


def run_six(plan: Plan, directory: Path, hooks: TrainHooks | None = None) -> list:
    return train_local(plan, config(checkpoint_dir=directory, measure_memory=False), hooks=hooks)


@pytest.mark.timeout(400)
def test_asymmetric_checkpoints_resume_under_alike_replicas_and_back(tmp_path: Path) -> None:
    """Six steps with a checkpoint every two: the asymmetric plan uninterrupted; the same plan
    stopped after step 3 and resumed (bit for bit); its step-4 checkpoint continued by alike
    replicas, and alike replicas' continued by the asymmetric plan (within 1e-5: other
    reduction orders)."""
    import shutil

    from train_plans import stop_after_step_3

    asymmetric, symmetric = asymmetric_plan(*ASYMMETRIC), tiny_plan(**SYMMETRIC)
    whole = run_six(asymmetric, tmp_path / "whole")
    with pytest.raises(Exception, match="StopTraining"):
        run_six(asymmetric, tmp_path / "stopped", TrainHooks(on_step=stop_after_step_3))
    resumed = run_six(asymmetric, tmp_path / "stopped")
    assert [r.step for r in resumed] == [4, 5]
    assert [r.loss for r in resumed] == [r.loss for r in whole[4:]]
    shutil.copytree(tmp_path / "whole", tmp_path / "to-symmetric")
    shutil.rmtree(checkpoint_path(tmp_path / "to-symmetric", 6))
    continued = run_six(symmetric, tmp_path / "to-symmetric")
    assert [r.step for r in continued] == [4, 5]
    assert max(abs(r.loss - w.loss) for r, w in zip(continued, whole[4:], strict=True)) <= TOL
    symmetric_whole = run_six(symmetric, tmp_path / "symmetric")
    shutil.copytree(tmp_path / "symmetric", tmp_path / "to-asymmetric")
    shutil.rmtree(checkpoint_path(tmp_path / "to-asymmetric", 6))
    back = run_six(asymmetric, tmp_path / "to-asymmetric")
    assert [r.step for r in back] == [4, 5]
    assert max(abs(r.loss - w.loss) for r, w in zip(back, symmetric_whole[4:], strict=True)) <= TOL
