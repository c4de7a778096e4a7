"""``medley train --tp``: the inline plan takes the tp flag of ``medley simulate`` (the same
layout), its default cluster has dp x sum(tp) devices on one node, bad degrees are one line naming
--tp, and a tp2 run on two gloo ranks trains as the same run on one rank (fp32, 1e-5)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cli.train_cmd import inline_plan
from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import InlineFlags, inline_layout

TOL = 1e-5
RUN = ["train", "--steps", "2", "--micro-batches", "2", "--seq-len", "32", "--json"]
SHAPE = dict(schedule="1f1b", micro_batches="2", micro_batch_size=2, seq_len=32, buckets=1)
FLAGS = dict(model="tiny", clip_grad=True, dtype="fp32")


def test_the_default_cluster_holds_dp_times_the_tp_degrees() -> None:
    plan = inline_plan(InlineFlags(pp=2, dp=2, tp="2,1", **SHAPE), cluster=None, **FLAGS)
    assert plan.cluster.num_devices == 2 * (2 + 1) and len(plan.cluster.nodes) == 1
    assert plan.layout.tp == (2, 1) and plan.world_size == 6
    assert sorted(d for r in range(2) for k in range(2) for d in plan.layout.group(r, k)) == list(range(6))
    assert inline_plan(InlineFlags(pp=2, dp=1, tp="1", **SHAPE), cluster=None, **FLAGS).layout.tp == ()


def test_train_builds_the_layout_simulate_builds() -> None:
    plan = inline_plan(InlineFlags(pp=2, dp=2, tp="2", **SHAPE), cluster="8xA100-80GB", **FLAGS)
    model = plan.layout.model
    simulated = inline_layout(
        cluster=plan.cluster, model=model, cost=CatalogCostSource.for_cluster(model, plan.cluster),
        pp=2, dp=2, schedule="1f1b", micro_batches="2", micro_batch_size=2, seq_len=32, virtual_stages=2,
        buckets=1, dtype="fp32", clip_grad=True, tp="2")
    assert plan.layout == simulated


@pytest.mark.parametrize(("tp", "said"), [
    ("3", "--tp (the plan's layout.tp): degree 3 of pipeline rank 0 is not one of (1, 2, 4, 8)"),
    ("0", "--tp '0': every value must be >= 1"),
    ("2,2", "--tp '2,2' gives 2 values; give 1 (or one for all)"),
    ("x", "--tp 'x' must be comma-separated integers"),
])
def test_a_bad_degree_is_one_line_naming_tp(tp: str, said: str) -> None:
    result = CliRunner().invoke(app, ["train", "--tp", tp, "--local-ranks", "2", "--steps", "1"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert said in lines[0], lines[0]


@pytest.mark.timeout(240)
def test_tp2_trains_as_one_rank() -> None:
    """Two steps of tiny on tp2 (two gloo ranks, one TP group) and on one rank: the same losses;
    the placement shows both TP ranks of pipeline rank 0."""
    tp2 = CliRunner().invoke(app, [*RUN, "--tp", "2", "--local-ranks", "2"])
    assert tp2.exit_code == 0, tp2.output
    one = CliRunner().invoke(app, [*RUN, "--local-ranks", "1"])
    assert one.exit_code == 0, one.output
    got, want = (json.loads(r.stdout[r.stdout.index("{"):]) for r in (tp2, one))
    placed = [(e["device"], e["pipeline_rank"], e["tp_rank"]) for e in got["placement"]]
    assert placed == [(0, 0, 0), (1, 0, 1)]
    losses = [(g["loss"], w["loss"]) for g, w in zip(got["records"], want["records"], strict=True)]
    assert len(losses) == 2 and max(abs(g - w) for g, w in losses) <= TOL, losses
