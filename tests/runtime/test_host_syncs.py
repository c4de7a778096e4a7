"""The step loop does not wait on the host: no host sync per micro-batch, none on a step that is
not logged, at most one on a logged step (``--log-every``), counted on every rank of a real
2-rank pipeline run (pp 2, ZeRO, clipping) by :mod:`host_syncs`. fp16 waits once per step for
its skip decision (``medley.runtime.precision.unscale_and_clip``), and only there.

The counts are attributed to the medley function that made them, so that a sync of the pipeline
executor (``runtime/executor.py``, ``runtime/sends.py``) shows as such, apart from the loop's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from host_syncs import count_after_step
from train_plans import config, tiny_plan

from medley.launch.spawn import train_local
from medley.runtime.config import TrainHooks

STEPS, LOG_EVERY = 9, 4
# Steps after which the ranks gather (the first step, 0, is not counted): every 4th and the last.
LOGGED = {3, 7, 8}
# Host work that waits for no device: the data is made and sliced on the host (the loop copies the
# micro-batches to the device after), and torch.optim reads its host step counter (host_syncs).
HOST_ONLY = ("data/", "torch.optim")  # frames named by their path under medley/


def syncs_by_step(tmp_path: Path, **settings: object) -> dict[int, list[dict[str, int]]]:
    """Train the plan with the counter; step -> each rank's syncs in it (host data left out)."""
    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="3,1", schedule="1f1b", micro_batches="6")
    hooks = TrainHooks(on_step=functools.partial(count_after_step, str(tmp_path)))
    run = config(steps=STEPS, log_every=LOG_EVERY, checkpoint_every=0, measure_memory=False, **settings)
    records = train_local(plan, run, hooks=hooks)
    assert [r.step for r in records] == list(range(STEPS))  # every step keeps its record
    by_step: dict[int, list[dict[str, int]]] = {}
    for rank in range(plan.world_size):
        for entry in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            kept = {where: n for where, n in entry["syncs"].items() if not where.startswith(HOST_ONLY)}
            by_step.setdefault(entry["step"], []).append(kept)
    assert sorted(by_step) == list(range(1, STEPS))
    return by_step


@pytest.mark.timeout(300)
def test_no_host_sync_per_micro_batch_and_one_per_logged_step(tmp_path: Path) -> None:
    """fp32, AdamW with clipping (the CLIP action's all-reduce every step), ZeRO-3 on stage 0."""
    by_step = syncs_by_step(tmp_path, clip_norm=1.0)
    for step, ranks in by_step.items():
        for rank, syncs in enumerate(ranks):
            executor = {w: n for w, n in syncs.items() if w.startswith(("runtime/executor.py",
                                                                       "runtime/sends.py"))}
            assert not executor, f"step {step}, rank {rank}: the pipeline executor syncs: {executor}"
            allowed = 1 if step in LOGGED else 0
            assert sum(syncs.values()) <= allowed, (
                f"step {step} ({'logged' if step in LOGGED else 'not logged'}), rank {rank}: "
                f"{sum(syncs.values())} host syncs, at most {allowed} wanted: {syncs}")
    # The logged steps do gather (the count is not vacuous): one tolist each, on every rank.
    for step in LOGGED:
        assert all(sum(s.values()) == 1 for s in by_step[step]), by_step[step]


@pytest.mark.timeout(300)
def test_fp16_waits_once_per_step_for_its_skip_decision(tmp_path: Path) -> None:
    by_step = syncs_by_step(tmp_path, dtype="fp16", clip_norm=1.0)
    for step, ranks in by_step.items():
        for rank, syncs in enumerate(ranks):
            skip = {w: n for w, n in syncs.items() if w.startswith("runtime/precision.py:unscale_and_clip")}
            rest = sum(syncs.values()) - sum(skip.values())
            assert sum(skip.values()) == 1, f"step {step}, rank {rank}: {syncs}"
            assert rest <= (1 if step in LOGGED else 0), f"step {step}, rank {rank}: {syncs}"
