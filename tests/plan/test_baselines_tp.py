"""Tensor parallelism in the baselines and the tp constraint: Metis-style gets uniform and
per-type degrees, a ``tp_degrees`` constraint keeps the search to those degrees, and the planner's
own space covers what the baselines find (never slower than any of them on small instances)."""

from __future__ import annotations

import pytest

from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.search.planner import search
from medley.search.rank.baselines import NAMES, metis_structures
from medley.search.rules.candidates import Estimator
from medley.search.space import Constraints, Structure
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

MIXED = "8xA100-40GB+8xV100-16GB"


def _estimator(cluster: str, model: str, global_batch: int, seq_len: int) -> Estimator:
    spec = parse_cluster_arg(cluster)
    m = get_model(model)
    return Estimator(spec, m, CatalogCostSource.for_cluster(m, spec), seq_len=seq_len,
                     global_batch=global_batch, memory_headroom=0.05)


def _groups_are_valid(est: Estimator, st: Structure) -> None:
    """Every TP group on one node and of one type, no device in two groups."""
    used: list[int] = []
    for k in range(st.pp):
        tp = st.tp_of(k)
        for row in st.assignment:
            group = [est.cluster.devices[d] for d in range(row[k], row[k] + tp)]
            assert len({(d.node, d.type.name) for d in group}) == 1
            used += range(row[k], row[k] + tp)
    assert len(used) == len(set(used))


def test_metis_style_chooses_tp_per_stage_group() -> None:
    est = _estimator(MIXED, "gpt-neo-2.7b", 64, 2048)
    structures = list(metis_structures(est, range(16), (1, 2), Constraints()))
    uniform = {st.tp_of(0) for st in structures if len(set(st.tp or (1,))) == 1}
    assert uniform == {1, 2, 4}  # gpt-neo-2.7b has 20 heads: 8 does not divide them
    mixed = [st for st in structures if len(set(st.tp)) > 1]
    assert mixed  # a degree per device type: more TP on the slower V100 stages
    fast = {d for d in range(8)}
    for st in mixed:
        a100 = [st.tp_of(k) for k in range(st.pp) if st.assignment[0][k] in fast]
        v100 = [st.tp_of(k) for k in range(st.pp) if st.assignment[0][k] not in fast]
        assert max(a100) <= min(v100)
    for st in structures:
        _groups_are_valid(est, st)
        assert st.num_devices <= 16


def test_tp_degrees_constraint_limits_the_search() -> None:
    cluster, model = parse_cluster_arg(MIXED), get_model("gpt-neo-2.7b")
    only_one = search(cluster, model, global_batch=64, seq_len=2048, top=3, baselines=False,
                      constraints=Constraints(tp_degrees=(1,)))
    assert all(set(g.tp) <= {1} for p in only_one.simulated for g in p.plan.groups)
    only_two = search(cluster, model, global_batch=64, seq_len=2048, top=3, baselines=False,
                      constraints=Constraints(tp_degrees=(2,)))
    assert all(set(g.tp) == {2} for p in only_two.simulated for g in p.plan.groups)
    with pytest.raises(MedleyInputError, match="tp_degrees"):
        search(cluster, model, global_batch=64, seq_len=2048, constraints=Constraints(tp_degrees=(3,)))


@pytest.mark.parametrize(
    ("cluster", "model", "global_batch", "seq_len"),
    [
        ("2xA100-80GB+4xT4-16GB", "tiny", 24, 128),  # tiny: at most 128 tokens
        ("4xH100-SXM-80GB+4xA100-80GB", "llama-2-7b", 32, 2048),
        ("8xH100-SXM-80GB+8xA100-80GB", "llama-2-7b", 16, 4096),
    ],
)
def test_planner_is_never_slower_than_a_baseline(cluster: str, model: str, global_batch: int,
                                                 seq_len: int) -> None:
    result = search(parse_cluster_arg(cluster), get_model(model), global_batch=global_batch,
                    seq_len=seq_len, top=1)
    assert tuple(result.baselines) == NAMES
    for name, plan in result.baselines.items():
        if plan is not None:
            assert result.best.tokens_per_s >= plan.tokens_per_s * (1 - 1e-9), name


def test_a_baseline_plan_is_adopted_only_within_the_allowed_schedules() -> None:
    """Baselines run their systems' own schedules; the search offers their plans among its own
    only when their family is one ``--schedules`` allows."""
    constraints = Constraints(schedules=("zb-h1",))
    result = search(parse_cluster_arg("2xA100-80GB+4xT4-16GB"), get_model("tiny"), global_batch=24,
                    seq_len=128, top=5, constraints=constraints)
    assert any(p is not None and p.plan.layout.schedule != "zb-h1" for p in result.baselines.values())
    assert {g.schedule for p in result.plans for g in p.plan.groups} == {"zb-h1"}
