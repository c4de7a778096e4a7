"""Round trip with torch's action CSV, checked against torch's own loader and schedules.

torch's loader needs a process group only for its sizes; the "fake" backend from torch's test
utilities gives one of any world size in a single process, so the real
``_PipelineScheduleRuntime._load_csv`` (validation, stage-to-rank inference, SEND/RECV and
UNSHARD/RESHARD lowering) runs here, followed by torch's zero-duration deadlock check.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.testing._internal.distributed.fake_pg import FakeStore

from medley.schedule.generators import FAMILIES, generate
from medley.schedule.ir import Action, Kind, PipelineSchedule, add_send_recv
from medley.schedule.torch_csv import (
    from_torch_rows,
    parse_torch_action,
    read_torch_csv,
    split_directions,
    to_torch_rows,
    write_torch_csv,
)
from medley.schedule.validate import ScheduleError, validate

KNOBS = {"interleaved": {"virtual_stages": 2}, "bidirectional": {"down_micro_batches": 3}}
_SKIP_IN_TORCH_SIM = {torch_schedules.UNSHARD, torch_schedules.RESHARD, torch_schedules.REDUCE_GRAD}


@pytest.fixture
def fake_group() -> Iterator[callable]:
    """Start a fake process group of the requested world size (rank 0); torn down after."""

    def start(world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_stages(schedule: PipelineSchedule) -> list[PipelineStage]:
    return [
        PipelineStage(torch.nn.Linear(2, 2), s, schedule.num_stages, torch.device("cpu"))
        for s in schedule.stages_of_rank(0)
    ]


def load_with_torch(schedule: PipelineSchedule, path: Path) -> dict:
    """torch's runtime loads the CSV; returns its lowered program after checking it runs."""
    runtime = torch_schedules._PipelineScheduleRuntime(
        torch_stages(schedule), n_microbatches=schedule.num_micro_batches
    )
    runtime._load_csv(str(path), format="compute_only")
    assert runtime.stage_index_to_group_rank == dict(enumerate(schedule.stage_to_rank))
    program = {
        rank: [a for a in actions if a.computation_type not in _SKIP_IN_TORCH_SIM]
        for rank, actions in runtime.pipeline_order_with_comms.items()
    }
    torch_schedules._simulate_comms_compute(
        program, lambda s: runtime.stage_index_to_group_rank[s], schedule.num_stages
    )
    return runtime.pipeline_order_with_comms


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("pp", "m"), [(1, 3), (2, 5), (4, 8), (3, 7)])
def test_generated_schedules_load_with_torch(
    family: str, pp: int, m: int, tmp_path: Path, fake_group
) -> None:
    schedule = generate(family, pp=pp, micro_batches=m, **KNOBS.get(family, {}))
    for part in split_directions(schedule):
        fake_group(part.num_ranks)
        path = tmp_path / f"{family}.csv"
        write_torch_csv(part, path)
        lowered = load_with_torch(part, path)
        back = read_torch_csv(path, num_micro_batches=part.num_micro_batches, family=family)
        assert back.actions == part.actions
        assert back.stage_to_rank == part.stage_to_rank
        # torch's lowered program (with its SEND/RECV/UNSHARD/RESHARD/REDUCE_GRAD) reads back and validates.
        validate(from_torch_rows([[str(a) for a in lowered[r]] for r in sorted(lowered)]))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FAMILIES), st.integers(1, 6), st.integers(1, 12))
def test_round_trip_keeps_every_action(family: str, pp: int, m: int) -> None:
    knobs = {"down_micro_batches": m // 2} if family == "bidirectional" else KNOBS.get(family, {})
    schedule = generate(family, pp=pp, micro_batches=m, **knobs)
    lowered = add_send_recv(schedule)
    for original in (schedule, lowered):
        back = from_torch_rows(
            to_torch_rows(original), num_micro_batches=m, family=family,
            micro_batch_stages=original.micro_batch_stages, stage_to_rank=original.stage_to_rank,
        )
        assert back.actions == original.actions
        assert back.stage_to_rank == original.stage_to_rank
        validate(back)


def test_torch_names() -> None:
    schedule = generate("zb-h1", pp=2, micro_batches=2)
    assert to_torch_rows(schedule)[1] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]
    assert to_torch_rows(generate("1f1b", pp=2, micro_batches=2))[1][:2] == ["1F0", "1B0"]
    assert parse_torch_action("(0F3;1B2)OVERLAP_F_B") == [Action(0, Kind.F, 3), Action(1, Kind.BW, 2)]
    assert parse_torch_action("") == []
    with pytest.raises(ValueError, match="not a torch pipeline action"):
        parse_torch_action("0X1")


def test_optim_and_buckets_are_rejected_or_dropped() -> None:
    base = generate("gpipe", pp=1, micro_batches=1)
    rows = [[*base.actions[0], Action(0, Kind.UNSHARD, bucket=1), Action(0, Kind.OPTIM)]]
    extended = base.with_actions(rows)
    with pytest.raises(ScheduleError, match="action 0UNSHARD@1: torch collectives act on whole stages"):
        to_torch_rows(extended)
    with pytest.raises(ScheduleError, match="action 0OPTIM: torch has no OPTIM"):
        to_torch_rows(base.with_actions([[*base.actions[0], Action(0, Kind.OPTIM)]]))
    assert to_torch_rows(extended, drop_unsupported=True) == [["0F0", "0B0"]]


TORCH_SCHEDULES = [
    ("1F1B", lambda pp: [0], 1),
    ("GPipe", lambda pp: [0], 1),
    ("Interleaved1F1B", lambda pp: [0, pp], 2),
    ("LoopedBFS", lambda pp: [0, pp], 2),
    ("InterleavedZeroBubble", lambda pp: [0, pp], 2),
    ("ZBVZeroBubble", lambda pp: [0, 2 * pp - 1], 2),
    ("DualPipeV", lambda pp: [0, 2 * pp - 1], 2),
]


@pytest.mark.parametrize(("name", "rank0_stages", "chunks"), TORCH_SCHEDULES)
def test_torch_schedules_load_into_medley_and_validate(
    name: str, rank0_stages, chunks: int, tmp_path: Path, fake_group
) -> None:
    pp, m = 4, 8
    fake_group(pp)
    stages = [
        PipelineStage(torch.nn.Linear(2, 2), s, pp * chunks, torch.device("cpu")) for s in rank0_stages(pp)
    ]
    cls = torch_schedules.get_schedule_class(name)
    torch_schedule = cls(stages[0] if chunks == 1 else stages, n_microbatches=m)
    path = tmp_path / f"{name}.csv"
    # torch's compute-only CSV layout (PipelineScheduleMulti._dump_csv; single-stage schedules lack it).
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(torch_schedule.pipeline_order.values())
    ours = read_torch_csv(path, num_micro_batches=m, family=name)
    assert ours.num_stages == pp * chunks and ours.num_ranks == pp
    if name == "1F1B":
        # torch 2.13's Schedule1F1B._get_pipeline_order (display only; its step() does not use it)
        # numbers the last rank's forwards from 1: 3F1..3F8 with 3B0..3B7. The validator says so.
        with pytest.raises(ScheduleError, match=r"rank 3, action 3BW0 \(position 1\): backward before its F"):
            validate(ours)
        return
    validate(ours)
    rows = [[str(a) for a in row if a is not None] for row in torch_schedule.pipeline_order.values()]
    if name != "DualPipeV":  # DualPipeV's OVERLAP_F_B cells come back as their parts
        assert to_torch_rows(from_torch_rows(rows)) == rows
