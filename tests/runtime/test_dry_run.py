"""The dry run (:mod:`medley.dryrun.ranks`, :mod:`medley.dryrun.checkpoint_plan`): ranks of
any plan built alone in a fake process group, their bytes against the memory model, and whether a
checkpoint of one plan loads under another, from DCP metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from train_plans import asymmetric_plan, tiny_plan, tp_plan

from medley.dryrun.checkpoint_plan import check_loadable, one_rank_plan, save_metadata
from medley.dryrun.ranks import build_rank, rank_cases
from medley.dryrun.traced_bytes import TOLERANCE
from medley.errors import MedleyInputError
from medley.plan.plan import Plan, load_plan
from medley.spec.adapter import LoraSpec
from medley.spec.model_arg import get_model

LARGE = Path(__file__).parents[1] / "data" / "large-1024-70b.toml"


def _with_dtype(plan: Plan, dtype: str) -> Plan:
    return Plan(groups=[dataclasses.replace(g, dtype=dtype) for g in plan.groups], cluster=plan.cluster)


def _lora(plan: Plan) -> Plan:
    """``plan`` with LoRA adapters (its base frozen, held in the compute dtype)."""
    lora = LoraSpec(rank=4, targets=("wq", "wv", "wo", "up", "down"))
    return Plan(groups=[dataclasses.replace(g, adapter=lora) for g in plan.groups], cluster=plan.cluster)


def _reports(plan: Plan, *, measure: bool = True) -> list:
    return [build_rank(plan, rank, case=case, measure=measure) for case in rank_cases(plan)
            for rank in case.built_ranks]


def test_every_distinct_rank_of_the_1024_device_70b_plan_matches_its_predicted_bytes() -> None:
    plan = load_plan(LARGE)
    cases = rank_cases(plan)
    # 12 pipeline ranks of TP 2 in 32 replicas: one case per pipeline rank, covering every rank once.
    assert plan.world_size == 768 and len(cases) == 12
    assert sorted(r for c in cases for r in c.ranks) == list(range(768))
    for case in cases[::4]:  # the embedding's stage, a middle one, a long one (all 12: medley check)
        for rank in case.built_ranks:
            report = build_rank(plan, rank, case=case)
            assert report.differences() == [], (rank, report.built, report.predicted)
            assert report.built.static > 2**30  # billions of bytes counted, on fake storage
            assert len(report.groups["tp"]) == 2 and len(report.groups["pipeline"]) == 12
            zero = [members for name, members in report.groups.items() if name.startswith("zero")]
            assert [len(m) for m in zero] == [32] and rank in zero[0]
            sharded = [s for s in report.shards if s.placements != "whole"]
            assert sharded and all(s.local != s.shape for s in sharded)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("plan", [
    pytest.param(lambda: tiny_plan(pp=2, dp=2, split="3,3", zero="1,3", schedule="1f1b",
                                   micro_batches="2,2", buckets=2), id="zero1-zero3"),
    pytest.param(lambda: tiny_plan(pp=2, dp=2, split="3,3", zero="0,2", schedule="1f1b",
                                   micro_batches="2,2"), id="zero0-zero2"),
    pytest.param(lambda: tp_plan(tp=(2, 1), dp=2, split="3,3", zero="3,0", schedule="1f1b",
                                 micro_batches="2,2"), id="tp2-tp1"),
    pytest.param(lambda: tiny_plan(pp=2, dp=2, split="2,1,1,2", zero="1,1,1,1", schedule="interleaved",
                                   micro_batches="4,4", virtual_stages=2), id="interleaved"),
    pytest.param(lambda: asymmetric_plan(
        dict(pp=2, dp=1, split="2,4", zero="1,1", schedule="1f1b", micro_batches="3"),
        dict(pp=1, dp=1, split="6", zero="1", schedule="1f1b", micro_batches="2")), id="replica-groups"),
    pytest.param(lambda: _lora(tiny_plan(pp=2, dp=2, split="3,3", zero="1,3", schedule="1f1b",
                                         micro_batches="2,2", buckets=2)), id="lora-zero1-zero3"),
    pytest.param(lambda: _lora(tp_plan(tp=(2, 1), dp=2, split="3,3", zero="0,2", schedule="1f1b",
                                       micro_batches="2,2")), id="lora-tp2-tp1"),
])
def test_small_plans_build_as_the_memory_model_books_them(plan, dtype: str) -> None:  # noqa: ANN001
    for report in _reports(_with_dtype(plan(), dtype)):
        assert report.differences() == [], (report.rank, report.built, report.predicted)
        if report.case.zero_dp > 1 and max(report.case.levels) > 0:
            assert report.built.grad_shard > 0  # the reduce-scatter ran and left a shard


def test_uneven_shards_are_found_at_the_last_member_of_the_zero_group() -> None:
    """Three replicas of the tiny model (width 64) at ZeRO-3: FSDP2 cuts 64 rows as 22, 22, 20,
    padding every shard to 22 rows; the memory model books 64 / 3 each. The last member's
    optimizer state (over its 20 rows) is 3.4% under the prediction."""
    plan = tiny_plan(pp=1, dp=3, split="6", zero="3", schedule="1f1b", micro_batches="2,2,2")
    (case,) = rank_cases(plan)
    assert case.built_ranks == (0, 2)
    first, last = (build_rank(plan, rank, case=case) for rank in case.built_ranks)
    assert first.differences() == []  # the padded full chunks: 1.7% over, within 2%
    assert [name for name, _, _ in last.differences()] == ["optimizer"]
    assert last.built.optimizer < last.predicted.optimizer * (1 - TOLERANCE)


def test_a_checkpoint_of_one_plan_covers_what_another_needs() -> None:
    saved = tp_plan(tp=(2, 2), dp=2, split="3,3", zero="3,0", schedule="1f1b", micro_batches="2,2")
    metadata = save_metadata(_reports(saved))
    loader = tiny_plan(pp=2, dp=3, split="2,4", zero="1,2", schedule="1f1b", micro_batches="2,2,2")
    for other in (loader, one_rank_plan(saved)):
        loaders = _reports(other, measure=False)
        assert check_loadable(metadata, loaders, saved_by="tp", loaded_by="other") > 100


def test_a_rank_missing_from_the_save_leaves_its_chunks_uncovered() -> None:
    plan = tiny_plan(pp=1, dp=2, split="6", zero="1", schedule="1f1b", micro_batches="2,2")
    (report,) = [build_rank(plan, 0, case=c) for c in rank_cases(plan)]
    alone = dataclasses.replace(report, case=dataclasses.replace(report.case, ranks=(0,)))
    loaders = _reports(one_rank_plan(plan), measure=False)
    with pytest.raises(MedleyInputError, match="the saved chunks hold .* of its"):
        check_loadable(save_metadata([alone]), loaders, saved_by="plan", loaded_by="one rank")
    check_loadable(save_metadata([report]), loaders, saved_by="plan", loaded_by="one rank")


def test_a_plan_of_another_model_cannot_load_the_checkpoint() -> None:
    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="0,0", schedule="1f1b", micro_batches="2")
    wider = dataclasses.replace(get_model("tiny"), name="tiny-wide", ffn_hidden_size=192)
    other = tiny_plan(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2", model=wider)
    with pytest.raises(MedleyInputError, match="mlp"):
        check_loadable(save_metadata(_reports(plan)), _reports(other, measure=False), saved_by="plan",
                       loaded_by="the wider model")
