"""One rank builder: ``medley check``'s dry run builds every rank as ``medley train`` does
(:func:`medley.runtime.setup.build_parts`), so a TP + sequence-parallel, ZeRO-3, selectively
recomputing plan whose replicas sit on the devices in another order than the plan lists them
gives the same modules, parameter shapes and placements rank by rank, the ranks numbered alike
(:func:`medley.runtime.placement.started_identities`)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from train_plans import config, save_shards, tiny_plan

from medley.dryrun.ranks import build_rank, rank_cases, rank_table
from medley.launch.spawn import train_local
from medley.runtime.train import TrainHooks


def test_the_dry_run_builds_each_rank_as_the_run_does(tmp_path: Path) -> None:
    # Replica 0 on devices 2-3, replica 1 on devices 0-1: global ranks are not the plan's order.
    plan = tiny_plan(pp=1, dp=2, split="6", zero="3", schedule="1f1b", micro_batches="2,2", devices=4, tp="2",
                     sequence_parallel=True, recompute_mode="selective", assignment="2;0", buckets=2)
    assert rank_table(plan) == (((2, 3),), ((0, 1),))
    train_local(plan, config(steps=1, checkpoint_every=0, measure_memory=False),
                hooks=TrainHooks(grad_hook=functools.partial(save_shards, str(tmp_path))))
    cases = {rank: case for case in rank_cases(plan) for rank in case.ranks}
    for rank in range(plan.world_size):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        report = build_rank(plan, rank, case=cases[rank], measure=False)
        dry = json.loads(json.dumps([dataclasses.asdict(shard) for shard in report.shards]))
        assert dry == real, f"rank {rank}"
        placements = {shard["placements"] for shard in real}
        assert "S(0), R" in placements and "S(0), S(1)" in placements  # SP's norms, TP's rows: ZeRO-3 of each
        assert report.groups["tp"] == ([2, 3] if rank >= 2 else [0, 1])
        assert report.rank_groups.place.replica == (0 if rank >= 2 else 1)
