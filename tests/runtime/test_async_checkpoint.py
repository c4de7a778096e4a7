"""``--async-checkpoint``: DCP's async save writes each checkpoint but the last in a thread while
training goes on. A run saving that way equals the single-process reference; a run stopped while a
save is in flight resumes from the checkpoint before it (the one in flight is never published)."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_plans import config, stop_after_step_3, tiny_plan

from medley.launch.spawn import RankFailure, train_local
from medley.runtime.checkpoint_layout import latest_checkpoint
from medley.runtime.config import TrainHooks
from medley.runtime.reference import reference_losses

TOL = 1e-5
PLAN = dict(pp=2, dp=1, split="2,4", zero="2,0", schedule="1f1b", micro_batches="8")


@pytest.mark.timeout(240)
def test_async_checkpoints_train_and_resume_as_the_reference(tmp_path: Path) -> None:
    want = reference_losses(tiny_plan(**PLAN).layout, config())
    saving = config(checkpoint_dir=tmp_path / "a", checkpoint_every=2, measure_memory=False)
    saving.checkpoint.async_save = True
    records = train_local(tiny_plan(**PLAN), saving)
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == ["step-00000004", "step-00000006"]
    stopped = config(checkpoint_dir=tmp_path / "b", checkpoint_every=2, measure_memory=False)
    stopped.checkpoint.async_save = True
    with pytest.raises(RankFailure, match="StopTraining"):  # the save of step 4 was still in flight
        train_local(tiny_plan(**PLAN), stopped, hooks=TrainHooks(on_step=stop_after_step_3))
    latest = latest_checkpoint(tmp_path / "b")
    assert latest is not None and latest.name == "step-00000002"
    resumed = train_local(tiny_plan(**PLAN), config(checkpoint_dir=tmp_path / "b", measure_memory=False))
    assert [r.step for r in resumed] == [2, 3, 4, 5]
    assert max(abs(r.loss - w) for r, w in zip(resumed, want[2:], strict=True)) <= TOL
