"""Tensor-parallel groups in a plan: which devices each pipeline rank uses, and what is refused."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import tomli_w

from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.plan.inline import inline_layout
from medley.plan.layout import PlanLayout, check_tp, tp_scattered, tp_sources, tp_undivided
from medley.plan.plan import Plan, load_plan, save_plan
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

CLUSTER = "4xA100-80GB+2xV100-32GB"


def _layout(**changes) -> tuple[PlanLayout, object]:
    cluster = parse_cluster_arg(CLUSTER)
    model = get_model("tiny")
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=2, dp=1,
        schedule="1f1b", micro_batches="4", micro_batch_size=2, seq_len=16, split="3,3", zero="0,0",
    )
    return dataclasses.replace(layout, **changes), cluster


def test_groups_are_consecutive_ids_and_set_the_world_size() -> None:
    layout, cluster = _layout(assignment=((2, 4),), tp=(2, 2))
    check_tp(layout, cluster)
    assert layout.group(0, 0) == (2, 3) and layout.group(0, 1) == (4, 5)
    assert layout.devices == (2, 3, 4, 5)
    assert layout.world_size == 4
    assert layout.stage_tp(1) == 2 and layout.tp_of(0) == 2


def test_no_tp_means_one_device_per_rank() -> None:
    layout, cluster = _layout(assignment=((4, 0),))
    check_tp(layout, cluster)
    assert layout.group(0, 0) == (4,) and layout.world_size == 2


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"assignment": ((0, 4),), "tp": (2,)}, ["one per pipeline rank"]),
        ({"assignment": ((0, 4),), "tp": (3, 1)}, ["degree 3"]),
        ({"assignment": ((3, 4),), "tp": (2, 1)}, ["one node of one device type"]),
        ({"assignment": ((0, 5),), "tp": (1, 2)}, ["cluster has 6"]),
        ({"assignment": ((0, 1),), "tp": (2, 1)}, ["overlap"]),
    ],
)
def test_bad_tp_is_refused_naming_the_flag(changes: dict, words: list[str]) -> None:
    layout, cluster = _layout(**changes)
    with pytest.raises(MedleyInputError) as err:
        check_tp(layout, cluster)
    assert "--tp" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_degree_must_divide_the_heads() -> None:
    layout, cluster = _layout(assignment=((0, 4),), tp=(8, 1))
    with pytest.raises(MedleyInputError, match="degree 8"):
        check_tp(layout, cluster)


def test_plan_file_carries_tp_and_refuses_a_bad_one(tmp_path: Path) -> None:
    layout, cluster = _layout(assignment=((0, 4),), tp=(2, 2), dtype="fp16")  # the V100s have no bf16
    save_plan(Plan(layout=layout, cluster=cluster), tmp_path / "plan.toml")
    assert load_plan(tmp_path / "plan.toml").layout == layout
    raw = tomllib.loads((tmp_path / "plan.toml").read_text())
    raw["layout"]["tp"] = [2, 4]
    (tmp_path / "bad.toml").write_text(tomli_w.dumps(raw))
    with pytest.raises(MedleyInputError) as err:
        load_plan(tmp_path / "bad.toml")
    assert "bad.toml" in str(err.value) and "--tp" in str(err.value)


def test_each_receiving_rank_has_one_source() -> None:
    assert tp_sources(senders=2, receivers=2) == (0, 1)
    assert tp_sources(senders=2, receivers=1) == (0,)
    assert tp_sources(senders=1, receivers=4) == (0, 0, 0, 0)
    assert tp_sources(senders=4, receivers=2) == (0, 1)


def test_only_hops_between_groups_of_one_degree_are_scattered() -> None:
    assert tp_scattered(senders=2, receivers=2) and tp_scattered(senders=8, receivers=8)
    assert not tp_scattered(senders=1, receivers=1)
    assert not tp_scattered(senders=2, receivers=1) and not tp_scattered(senders=2, receivers=4)


def test_a_degree_must_divide_the_hidden_size_a_scattered_hop_slices() -> None:
    """Heads, KV heads and MLP width divide by 2, the hidden states (65 wide) do not."""
    model = dataclasses.replace(get_model("tiny"), hidden_size=65, explicit_head_dim=16)
    assert tp_undivided(model, 2) == "hidden_size (65)"
    assert tp_undivided(get_model("tiny"), 2) is None
