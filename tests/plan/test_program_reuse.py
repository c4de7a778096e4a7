"""What lets the simulation share work between plans: the ZeRO placement keeps each rank's compute
and point-to-point actions in the generator's order (so a program validated once is valid in every
plan that runs it, :mod:`medley.lowering.predict`), and replicas of one micro-batch count get equal
programs from one generated schedule (:func:`medley.plan.layout.build_schedules`)."""

from __future__ import annotations

import pytest

from medley.errors import MedleyInputError
from medley.plan.layout import PlanLayout
from medley.plan.world import build_schedules
from medley.schedule.generators import generate
from medley.schedule.ir import COLLECTIVE_KINDS
from medley.schedule.zero_settings import Placement, StageZero
from medley.spec.model_arg import get_model

MODEL = get_model("tiny")


def _layout(schedule: str, knobs: dict, zero: StageZero, placement: Placement, clip: bool) -> PlanLayout:
    pp, dp = 2, 3
    stages = pp * knobs.get("virtual_stages", 1)
    split = [MODEL.num_layers // stages] * stages
    split[0] += MODEL.num_layers - sum(split)
    return PlanLayout(
        model=MODEL, pp=pp, dp=dp, assignment=tuple(tuple(r * pp + k for k in range(pp)) for r in range(dp)),
        stage_layers=tuple(split), schedule=schedule, knobs=knobs, micro_batches=(6, 6, 4),
        micro_batch_size=1, seq_len=32, zero=(zero,) * stages, placement=placement, clip_grad=clip,
    )


@pytest.mark.parametrize(("schedule", "knobs"), [
    ("1f1b", {}), ("zb-h1", {}), ("gpipe", {}), ("interleaved", {"virtual_stages": 2}),
    ("hetero-1f1b", {"warmup": [3, 1]}),
])
@pytest.mark.parametrize("zero", [
    StageZero(level=1, buckets=2), StageZero(level=3, buckets=2, gather_windows=1),
    StageZero(level=2, buckets=2, grad_windows=2),
])
@pytest.mark.parametrize(("placement", "clip"), [(Placement.BUBBLE, False), (Placement.NAIVE, True)])
def test_placement_keeps_the_generated_compute_and_transfers(schedule, knobs, zero, placement, clip) -> None:
    layout = _layout(schedule, knobs, zero, placement, clip)
    try:
        placed = build_schedules(layout)
    except MedleyInputError as err:  # per-use ZeRO-3 gathers with unequal counts on interleaved ranks
        assert schedule == "interleaved" and zero.level == 3 and placement is Placement.NAIVE, err
        return
    assert len(placed) == layout.dp
    for m, program in zip(layout.micro_batches, placed, strict=True):
        generated = generate(schedule, pp=layout.pp, micro_batches=m, **knobs)
        kept = [[a for a in row if a.kind not in COLLECTIVE_KINDS] for row in program.actions]
        assert kept == generated.actions
        assert any(a.kind in COLLECTIVE_KINDS for row in program.actions for a in row)
        assert (program.stage_to_rank, program.num_micro_batches) == (generated.stage_to_rank, m)
    assert placed[0].actions == placed[1].actions and placed[0] is not placed[1]
