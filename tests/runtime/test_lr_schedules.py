"""Learning-rate schedules (``--lr-schedule cosine|linear|constant|wsd``) and their length across a
resume (issue 43, finding 4): the schedule is fixed at a run's start and recorded in its
checkpoints; a resume whose schedule differs (a longer ``--steps`` re-stretched the cosine, lr
3.7e-4 jumped to 1.4e-3) is refused in one line unless ``--extend-schedule``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from train_plans import config, stop_after_step_3, tiny_plan

from medley.launch.spawn import RankFailure, train_local
from medley.runtime.config import TrainHooks
from medley.runtime.optim import SCHEDULES, lr_at

LR, MIN_LR = 1.0, 0.1
MEDLEY = str(Path(sys.executable).with_name("medley"))
TRAIN = [MEDLEY, "train", "--local-ranks", "1", "--seq-len", "16", "--dtype", "fp32", "--json"]


def test_each_schedule_by_hand() -> None:
    # Two warm-up steps, then eight to step 10.
    at = {kind: [lr_at(s, lr=LR, min_lr=MIN_LR, warmup_steps=2, total_steps=10, schedule=kind,
                       decay_fraction=0.25) for s in range(11)] for kind in SCHEDULES}
    assert at["linear"][:2] == at["cosine"][:2] == [0.5, 1.0]
    assert at["linear"][2:] == pytest.approx([1.0 - 0.9 * k / 8 for k in range(9)])
    assert at["cosine"][6] == pytest.approx(MIN_LR + 0.45 * (1 + math.cos(math.pi / 2)))
    assert at["constant"][2:] == [1.0] * 9
    # wsd: at lr for the first 3/4 of the 8 steps after warm-up, then linear to min_lr over 2.
    assert at["wsd"][2:9] == [1.0] * 7
    assert at["wsd"][9:] == pytest.approx([0.55, 0.1])


@given(kind=st.sampled_from(SCHEDULES), warmup=st.integers(0, 20), total=st.integers(1, 200),
       fraction=st.floats(0.01, 1.0))
def test_after_warm_up_no_schedule_rises_or_leaves_its_range(kind: str, warmup: int, total: int,
                                                             fraction: float) -> None:
    lrs = [lr_at(s, lr=LR, min_lr=MIN_LR, warmup_steps=warmup, total_steps=total, schedule=kind,
                 decay_fraction=fraction) for s in range(warmup, max(warmup, total) + 3)]
    assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:], strict=False))
    assert all(MIN_LR - 1e-12 <= lr <= LR for lr in lrs)
    end = lr_at(max(warmup + 1, total), lr=LR, min_lr=MIN_LR, warmup_steps=warmup, total_steps=total,
                schedule=kind, decay_fraction=fraction)
    assert end == pytest.approx(LR if kind == "constant" else MIN_LR)


PLAN = {"pp": 2, "dp": 1, "split": "3,3", "zero": "1,1", "schedule": "1f1b", "micro_batches": "2"}


@pytest.mark.timeout(240)
def test_a_stopped_wsd_run_resumes_on_its_curve(tmp_path: Path) -> None:
    """Six steps of wsd with two of warm-up, the last 3/4 of the other four decaying: stopped after
    step 3 (its checkpoint after step 3), resumed; the resumed steps' lr are the schedule's."""
    run = config(checkpoint_dir=tmp_path / "ckpt", lr_schedule="wsd", decay_fraction=0.75, lr=2e-3,
                 min_lr=2e-4, measure_memory=False)
    with pytest.raises(RankFailure, match="stopped after step 3"):
        train_local(tiny_plan(**PLAN), run, hooks=TrainHooks(on_step=stop_after_step_3))
    records = train_local(tiny_plan(**PLAN), run)
    assert [r.step for r in records] == [4, 5]
    # Progress after warm-up (s - 2) / 4; decaying past 1/4: 2e-3 - 1.8e-3 x (progress - 1/4) / (3/4).
    assert [r.lr for r in records] == pytest.approx([2e-3 - 1.8e-3 / 3, 2e-3 - 1.8e-3 * 2 / 3])


def _train(directory: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRAIN, "--checkpoint-dir", str(directory), *flags], capture_output=True,
                          text=True, timeout=200, check=False)


@pytest.mark.timeout(300)
def test_a_longer_resume_is_refused_without_extend_schedule(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    first = _train(directory, "--steps", "2")
    assert first.returncode == 0, first.stderr
    longer = _train(directory, "--steps", "4")
    lines = [line for line in longer.stderr.splitlines() if line.strip()]
    assert longer.returncode == 2 and len(lines) == 1, longer.stderr
    assert "cosine over 2 steps" in lines[0] and "cosine over 4 steps" in lines[0]
    assert "--extend-schedule" in lines[0]
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("step-")) == ["step-00000002"]
    extended = _train(directory, "--steps", "4", "--extend-schedule")
    assert extended.returncode == 0, extended.stderr
    assert (f"resuming {directory / 'step-00000002'} with a new schedule (--extend-schedule): "
            "cosine over 2 steps, lr 0.003 -> 0.0003, 5 warm-up -> cosine over 4 steps, lr 0.003 -> 0.0003, "
            "5 warm-up") in extended.stderr
