"""What a pipeline stage holds does not grow with the step's micro-batches where its schedule
keeps the same number in flight: 1F1B's last stage runs each micro-batch's forward and backward
back to back, so only the losses (scalars) and the sends not yet known delivered
(:mod:`medley.runtime.sends`, at most a couple) may outlive a micro-batch."""

from __future__ import annotations

import pytest
from train_plans import MICRO_BATCH_SIZE, SEQ_LEN, config, tiny_plan

from medley.launch.spawn import train_local
from medley.spec.model_arg import get_model


def _last_stage_peak(micro_batches: int) -> int:
    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="0,0", schedule="1f1b", micro_batches=str(micro_batches))
    records = train_local(plan, config(steps=1, checkpoint_every=0, clip_norm=None))
    return records[-1].peak_memory_bytes[1]


@pytest.mark.timeout(240)
def test_last_stage_memory_does_not_grow_with_micro_batches() -> None:
    activation = MICRO_BATCH_SIZE * SEQ_LEN * get_model("tiny").hidden_size * 4
    few, many = _last_stage_peak(2), _last_stage_peak(8)
    # Before the received inputs were let go with each backward, 8 micro-batches held 6 more.
    assert many - few <= activation, (few, many, activation)
