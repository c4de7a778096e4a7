"""The simulator's work grows linearly in data-parallel replicas (issue 26: `medley simulate --model
tiny --seq-len 64 --cluster 65536xA100-80GB --pp 1 --dp N --micro-batches 1` took 3.8 s at dp 1,000,
109 s at dp 8,000 and did not end at 50,000: every replica walked and hashed its dp-wide ZeRO group).
Work is counted, not timed: the group tuples the collective table hands out count every element
visit the simulator makes through them (iteration, membership, index, hashing)."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cli.simulate_cmd import MAX_ROWS, device_rows, ranges
from medley.cost.estimator import CatalogCostSource
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.schedule.ir import Action
from medley.sim.engine import simulate
from medley.sim.problem import CollectiveCost
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


class CountingGroup(tuple):
    """A group tuple that counts the elements every walk over it visits."""

    visits = 0

    def __iter__(self):  # noqa: ANN204 - tuple's own signature
        CountingGroup.visits += len(self)
        return super().__iter__()

    def __contains__(self, item: object) -> bool:
        CountingGroup.visits += len(self)
        return super().__contains__(item)

    def index(self, *args: object) -> int:  # type: ignore[override]
        CountingGroup.visits += len(self)
        return super().index(*args)

    def __hash__(self) -> int:
        CountingGroup.visits += len(self)
        return super().__hash__()


def work(dp: int, *, zero: str = "1") -> tuple[int, int, int]:
    """(element visits through the groups, distinct group objects, table answers) of simulating
    tiny at pp 1 x dp ``dp``, one micro-batch each."""
    cluster, model = parse_cluster_arg("65536xA100-80GB"), get_model("tiny")
    cost = CatalogCostSource.for_cluster(model, cluster)
    layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=1, dp=dp, schedule="1f1b",
                           micro_batches="1", micro_batch_size=1, seq_len=64, zero=zero)
    problem = compile_problem(layout, cluster, cost)
    table = problem.collectives
    assert table is not None
    wrapped: dict[int, CountingGroup] = {}
    answers = [0]

    def counting(replica: int, action: Action) -> CollectiveCost:
        found = table(replica, action)
        answers[0] += 1
        group = wrapped.setdefault(id(found.group), CountingGroup(found.group))
        return dataclasses.replace(found, group=group)

    CountingGroup.visits = 0
    simulate(dataclasses.replace(problem, collectives=counting))
    return CountingGroup.visits, len(wrapped), answers[0]


@pytest.mark.parametrize("zero", ["1", "3"])
def test_zero_group_work_grows_linearly_in_dp(zero: str) -> None:
    small, small_groups, small_answers = work(100, zero=zero)
    large, large_groups, large_answers = work(400, zero=zero)
    assert large_answers == 4 * small_answers  # every replica asks for each of its actions
    assert small_groups == large_groups <= 2  # the stage's DP group and the CLIP's world, built once
    # Linear: 4x the replicas, about 4x the visits (quadratic work, as before, gives 16x).
    assert large <= 5 * small, (small, large)


def test_many_alike_devices_share_a_table_row() -> None:
    """Past 64 devices the per-device table merges devices of equal figures (dp 100: one row)."""
    args = ["simulate", "--model", "tiny", "--seq-len", "64", "--cluster", "128xA100-80GB", "--pp", "1",
            "--dp", "100", "--micro-batches", "1"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith("│") and "A100-80GB" in line]
    assert len(rows) == 1 and "0-99" in rows[0] and "0-99/0" in rows[0], result.output


def test_a_step_of_too_many_actions_is_one_line() -> None:
    """Streamed ZeRO-3 over 98 buckets multiplies a replica's actions (590 each): dp 1,800 is
    1,062,000 actions, past the 1,000,000 the simulator runs in seconds, refused before any replica
    is built."""
    args = ["simulate", "--model", "gpt-3-175b", "--seq-len", "64", "--cluster", "65536xA100-80GB", "--pp",
            "1", "--dp", "1800", "--micro-batches", "1", "--zero", "3", "--buckets", "98",
            "--gather-windows", "0"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "1,062,000 actions" in lines[0] and "the limit is 1,000,000" in lines[0]
    assert "--dp, --micro-batches, --zero, --buckets, --gather-windows" in lines[0]


def test_a_table_of_many_unlike_rows_keeps_its_first_and_last() -> None:
    devices = [{"device": d, "type": "A100-80GB", "node": "n", "replica": d, "rank": 0, "tp": 1, "tp_rank": 0,
                "stages": [0], "busy": d / 1000, "idle": 0.0, "bubble": 0.0, "exposed_transfer_s": 0.0,
                "exposed_zero_s": 0.0, "exposed_clip_s": 0.0, "clip_barrier_s": 0.0, "peak_memory_gb": 90.0,
                "headroom_gb": -10.0, "fits": False} for d in range(200)]
    rows = device_rows(devices)
    assert len(rows) == MAX_ROWS + 1 and rows[0][0] == "0" and rows[-1][0] == "199"
    assert rows[MAX_ROWS - 16][:2] == ["...", "136 more rows (136 OOM); --json lists every device"]


def test_ranges() -> None:
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranges(list(range(0, 400, 2))) == "0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,... (200)"
