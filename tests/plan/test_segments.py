"""Sync segments (:mod:`medley.plan.segments`) and plans of replica groups of their own shape: the
file format, what the loader refuses, and the invariant every plan keeps (each layer in exactly one
segment, held once by every replica)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medley.errors import MedleyInputError
from medley.plan import world
from medley.plan.layout import PlanLayout
from medley.plan.plan import Plan, load_plan, plan_to_dict, save_plan
from medley.plan.segments import joined
from medley.plan.world import build_world
from medley.schedule import world_order
from medley.schedule.zero_settings import StageZero
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

DOC = Path(__file__).parents[2] / "docs" / "plan-format.md"
TINY = get_model("tiny")  # 6 layers: embedding, 4 blocks, head


def group(*, pp: int, dp: int, first: int, split: tuple[int, ...], micro_batches: tuple[int, ...],
          level: int = 1, schedule: str = "1f1b", tp: int = 1, **extra: object) -> PlanLayout:
    """A group of ``dp`` alike replicas on consecutive devices from ``first``."""
    assignment = tuple(tuple(first + (r * pp + k) * tp for k in range(pp)) for r in range(dp))
    return PlanLayout(model=TINY, pp=pp, dp=dp, assignment=assignment, stage_layers=split, schedule=schedule,
                      micro_batches=micro_batches, micro_batch_size=2, seq_len=16,
                      zero=tuple(StageZero(level=level) for _ in split), tp=(tp,) * pp if tp > 1 else (),
                      **extra)  # type: ignore[arg-type]


def test_the_documented_version_2_example_loads(tmp_path: Path) -> None:
    example = DOC.read_text().split("```toml\n")[2].split("```", 1)[0]
    (tmp_path / "plan.toml").write_text(example)
    plan = load_plan(tmp_path / "plan.toml")
    assert plan.asymmetric and plan.world_size == 3
    assert [g.stage_layers for g in plan.groups] == [(2, 4), (6,)]
    assert plan.micro_batches == (3, 2)
    segments = build_world(plan.groups).segments.segments
    assert [(s.first, s.stop) for s in segments] == [(0, 2), (2, 6)]
    assert [[(h.group, h.stage) for h in s.holders] for s in segments] == [[(0, 0), (1, 0)], [(0, 1), (1, 0)]]


def test_plans_round_trip_and_alike_replicas_stay_version_1(tmp_path: Path) -> None:
    cluster = parse_cluster_arg("7xA100-80GB")
    groups = [group(pp=3, dp=1, first=0, split=(2, 2, 2), micro_batches=(3,)),
              group(pp=2, dp=2, first=3, split=(3, 3), micro_batches=(2, 1), schedule="zb-h1")]
    plan = Plan(groups=groups, cluster=cluster)
    assert plan_to_dict(plan)["version"] == 2
    save_plan(plan, tmp_path / "plan.toml")
    again = load_plan(tmp_path / "plan.toml")
    assert again.groups == plan.groups and again.groups[0].sync_dp == 3
    alike = Plan(layout=groups[1], cluster=cluster)
    assert plan_to_dict(alike)["version"] == 1 and "replicas" not in plan_to_dict(alike)["layout"]


def _refused(tmp_path: Path, groups: list[PlanLayout], words: list[str], devices: int = 8) -> None:
    plan = Plan(groups=groups, cluster=parse_cluster_arg(f"{devices}xA100-80GB"))
    raw = plan_to_dict(plan)
    (tmp_path / "bad.toml").write_text(__import__("tomli_w").dumps(raw))
    with pytest.raises(MedleyInputError) as err:
        load_plan(tmp_path / "bad.toml")
    message = str(err.value)
    assert str(tmp_path / "bad.toml") in message and "\n" not in message
    for word in words:
        assert word in message


def test_holders_that_disagree_are_refused_naming_the_layers(tmp_path: Path) -> None:
    a = group(pp=2, dp=1, first=0, split=(2, 4), micro_batches=(2,))
    _refused(tmp_path, [a, group(pp=1, dp=1, first=2, split=(6,), micro_batches=(2,), level=2)],
             ["layers 0..1", "ZeRO level", "layout.zero"])
    _refused(tmp_path, [a, group(pp=1, dp=1, first=2, split=(6,), micro_batches=(2,), tp=2)],
             ["TP 1 and 2", "layout.tp"])
    _refused(tmp_path, [a, group(pp=1, dp=1, first=1, split=(6,), micro_batches=(2,))],
             ["device 1 is used by two replicas"])
    _refused(tmp_path, [a, group(pp=2, dp=1, first=2, split=(3, 3, 3, 3), micro_batches=(2,),
                                 schedule="bidirectional")], ["bidirectional"])


@st.composite
def asymmetric_groups(draw: st.DrawFn) -> list[PlanLayout]:
    """2 to 4 replicas in 1 to 3 groups of random depth and split over tiny's 6 layers."""
    count = draw(st.integers(2, 4))
    sizes, left = [], count
    while left:
        size = draw(st.integers(1, left))
        sizes.append(size)
        left -= size
    groups, first = [], 0
    for dp in sizes:
        pp = draw(st.integers(1, 4))
        cuts = sorted(draw(st.sets(st.integers(1, 5), min_size=pp - 1, max_size=pp - 1)))
        split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, 6], strict=True))
        micro_batches = tuple(draw(st.integers(1, 4)) for _ in range(dp))
        groups.append(group(pp=pp, dp=dp, first=first, split=split, micro_batches=micro_batches,
                            level=draw(st.sampled_from((0, 1, 2)))))
        first += pp * dp
    level = groups[0].zero[0].level  # the holders of a layer share a level: one for the whole plan
    return [dataclasses.replace(g, zero=tuple(StageZero(level=level) for _ in g.zero)) for g in groups]


@settings(max_examples=60, deadline=None)
@given(groups=asymmetric_groups())
def test_segments_cover_every_layer_exactly_once_per_replica(groups: list[PlanLayout]) -> None:
    world = build_world(joined(groups))
    segments = world.segments
    replicas = sum(g.dp for g in groups)
    assert [s.first for s in segments.segments] == sorted({s.first for s in segments.segments})
    covered = [layer for s in segments.segments for layer in s.layers]
    assert covered == list(range(TINY.num_layers))  # each layer in one segment, in order
    for segment in segments.segments:
        assert [h.replica for h in segment.holders] == list(range(replicas))  # once per replica
        for h in segment.holders:
            layout = groups[h.group]
            held = layout.layer_range(h.stage)
            assert held.start <= segment.first and segment.stop <= held.stop
    for g, layout in enumerate(groups):
        buckets = segments.bucket_layers(g)
        assert all(sum(buckets[s]) == layout.stage_layers[s] for s in range(layout.num_stages))
        for replica in range(layout.dp):
            schedule = world.schedules[segments.first_replica[g] + replica]
            assert schedule.bucket_layers == buckets


def test_tied_embeddings_are_refused_with_replica_groups_and_never_planned() -> None:
    """The runtime does not yet sum a tied embedding's copies across replica groups: medley train
    refuses such a plan in one line, and the planner does not make one."""
    from medley.cost.estimator import CatalogCostSource
    from medley.runtime.setup import check_plan
    from medley.search.rules.asymmetric import grouped_candidates
    from medley.search.rules.candidates import Estimator

    tied = dataclasses.replace(TINY, name="tiny-tied", tied_embeddings=True)
    groups = [dataclasses.replace(group(pp=2, dp=1, first=0, split=(2, 4), micro_batches=(2,)), model=tied),
              dataclasses.replace(group(pp=1, dp=1, first=2, split=(6,), micro_batches=(2,)), model=tied)]
    cluster = parse_cluster_arg("3xA100-80GB")
    with pytest.raises(MedleyInputError, match="ties its embeddings.*layout.replicas"):
        check_plan(Plan(groups=groups, cluster=cluster), 3)
    cluster = parse_cluster_arg("2xA100-80GB+2xV100-32GB")
    est = Estimator(cluster, tied, CatalogCostSource.for_cluster(tied, cluster), seq_len=16, global_batch=8,
                    memory_headroom=0.05)
    parts = cluster.devices_by_type()
    assert grouped_candidates(est, [parts], [(1, 1)], ("1f1b",), max_pp=6) == []
    untied = Estimator(cluster, TINY, CatalogCostSource.for_cluster(TINY, cluster), seq_len=16,
                       global_batch=8, memory_headroom=0.05)
    assert grouped_candidates(untied, [parts], [(1, 1)], ("1f1b",), max_pp=6)  # the same, untied: planned


@settings(max_examples=40, deadline=None)
@given(groups=asymmetric_groups())
def test_walking_one_replica_per_group_and_program_gives_the_verdict_of_walking_all(
        groups: list[PlanLayout]) -> None:
    """build_world's world-order check walks one stand-in per (group, program); on every drawn
    world it reaches the verdict the walk over every replica reaches (the drawn worlds all run, so
    this finds false hangs; tests/schedule/test_world_order.py has worlds that hang)."""
    verdicts: list[tuple[bool, bool]] = []

    def both(schedules, key, kin):  # noqa: ANN001, ANN202 - check_world_order's signature
        found = []
        for k in (kin, None):
            try:
                world_order.check_world_order(schedules, key, kin=k)
                found.append(False)
            except world_order.WorldOrderError:
                found.append(True)
        verdicts.append((found[0], found[1]))
        if found[0]:
            raise world_order.WorldOrderError("hangs")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(world, "check_world_order", both)
        try:
            world.build_world(joined(groups))
        except MedleyInputError:
            pass
    assert all(walked == every for walked, every in verdicts)
