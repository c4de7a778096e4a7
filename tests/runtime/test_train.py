"""Training runs launched through torchelastic (gloo, CPU): losses equal the single-process
reference, checkpoints resume bit-identically, under another plan, and after a killed rank.

Launches are few and shared (each costs seconds): the uninterrupted run of plan A is the
baseline of the resume tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from train_plans import config, crash_rank_one_once, stop_after_step_3, tiny_plan

from medley.launch.spawn import RankFailure, train_local
from medley.runtime.checkpoint_layout import checkpoint_path
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.reference import reference_losses
from medley.runtime.train import TrainHooks

TOL = 1e-5
# A: 4 ranks, zero-bubble, ZeRO-3 and ZeRO-1 stages, replicas with 5 and 3 micro-batches.
PLAN_A = dict(pp=2, dp=2, split="3,3", zero="3,1", schedule="zb-h1", micro_batches="5,3", buckets=2)
# B: 2 ranks, one pipeline, ZeRO-2 then ZeRO-0, another split.
PLAN_B = dict(pp=2, dp=1, split="2,4", zero="2,0", schedule="1f1b", micro_batches="8")
# C: 2 replicas of the whole model, ZeRO-2, uneven micro-batch counts, blocks recomputed.
PLAN_C = dict(pp=1, dp=2, split="6", zero="2", schedule="gpipe", micro_batches="3,5", recompute=True)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[Path, list]:
    """Plan A, six steps, a checkpoint every two steps."""
    directory = tmp_path_factory.mktemp("ckpt_a")
    records = train_local(tiny_plan(**PLAN_A), config(checkpoint_dir=directory))
    return directory, records


def copy_without_last(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    shutil.rmtree(checkpoint_path(target, 6))
    return target


@pytest.mark.timeout(240)
def test_plan_a_matches_the_reference(baseline) -> None:
    _, records = baseline
    plan = tiny_plan(**PLAN_A)
    want = reference_losses(plan.layout, config())
    assert [r.step for r in records] == list(range(6))
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    assert all(r.grad_norm > 1.0 for r in records[:2]), "clipping must be active in this test"
    assert all(r.step_time_s > 0 and r.tokens_per_s > 0 and r.mfu is None for r in records)
    assert set(records[0].peak_memory_bytes) == {0, 1, 2, 3}


@pytest.mark.timeout(240)
def test_plan_c_matches_the_reference(tmp_path) -> None:
    plan = tiny_plan(**PLAN_C)
    records = train_local(plan, config(steps=3, checkpoint_every=0, measure_memory=False))
    want = reference_losses(plan.layout, config(steps=3))
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL


@pytest.mark.timeout(240)
def test_killed_rank_resumes_from_the_last_checkpoint(baseline, tmp_path) -> None:
    """Rank 1 dies after step 4 (the last checkpoint is after step 3); torchelastic restarts every
    rank, training resumes at step 4 and ends equal, bit for bit, to the uninterrupted run."""
    _, uninterrupted = baseline
    directory, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    # Every step logged (--log-every 1): with the default 10 a step's record is written at the next
    # gather, and the first try's step 4 died before one.
    records = train_local(tiny_plan(**PLAN_A), config(checkpoint_dir=directory, log_jsonl=log, log_every=1),
                          hooks=TrainHooks(on_step=crash_rank_one_once), max_restarts=1)
    assert [r.step for r in records] == [4, 5]
    assert [r.loss for r in records] == [r.loss for r in uninterrupted[4:]]
    logged = [json.loads(line)["step"] for line in log.read_text().splitlines() if '"step"' in line]
    assert logged == [0, 1, 2, 3, 4, 4, 5]  # step 4 ran twice, its first update died with the ranks
    state = {"train.next_step": __import__("torch").zeros((), dtype=__import__("torch").int64),
             "optim.blocks.0.attn.wq.weight.step": __import__("torch").zeros(())}
    dcp.load(state, storage_reader=SafeReader(checkpoint_path(directory, 6)), no_dist=True)
    assert int(state["train.next_step"]) == 6
    assert float(state["optim.blocks.0.attn.wq.weight.step"]) == 6.0  # no lost, no repeated update


@pytest.mark.timeout(240)
def test_resume_under_another_plan(baseline, tmp_path) -> None:
    """Plan A's checkpoint after four steps, continued by plan B (other pp, dp, split, ZeRO)."""
    source, uninterrupted = baseline
    directory = copy_without_last(source, tmp_path / "ckpt")
    records = train_local(tiny_plan(**PLAN_B), config(checkpoint_dir=directory, measure_memory=False))
    assert [r.step for r in records] == [4, 5]
    assert max(abs(r.loss - u.loss) for r, u in zip(records, uninterrupted[4:], strict=True)) <= TOL


@pytest.mark.timeout(240)
def test_resume_into_zero1_and_zero3_from_another_plan(tmp_path) -> None:
    """The other direction: plan C (ZeRO-2, one stage) stops after four of six steps (as at a
    job's time limit, its checkpoint saved); plan A (ZeRO-3 and ZeRO-1 stages) finishes the run,
    equal to the reference."""
    directory = tmp_path / "ckpt"
    # Every rank stops after step 3; whichever torchelastic saw first is named.
    with pytest.raises(RankFailure, match=r"rank \d failed .StopTraining: stopped after step 3"):
        train_local(tiny_plan(**PLAN_C), config(checkpoint_dir=directory, measure_memory=False),
                    hooks=TrainHooks(on_step=stop_after_step_3))
    records = train_local(tiny_plan(**PLAN_A), config(checkpoint_dir=directory, measure_memory=False))
    want = reference_losses(tiny_plan(**PLAN_A).layout, config())
    assert [r.step for r in records] == [4, 5]
    assert max(abs(r.loss - w) for r, w in zip(records, want[4:], strict=True)) <= TOL
