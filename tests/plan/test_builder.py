"""The candidate builder's rules: the plain splitters, and build() under simple configurations."""

from __future__ import annotations

from medley.cost.estimator import CatalogCostSource
from medley.plan.layout import speed_split, uniform_split
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.rules.candidates import Estimator
from medley.search.space import Structure, memory_option
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

TINY = get_model("tiny")


def _estimator(cluster: str = "2xA100-80GB+2xV100-32GB") -> Estimator:
    spec = parse_cluster_arg(cluster)
    return Estimator(spec, TINY, CatalogCostSource.for_cluster(TINY, spec), seq_len=128, global_batch=16,
                     memory_headroom=0.05)


def test_speed_split_follows_speed_and_gives_every_stage_a_layer() -> None:
    split = speed_split(TINY, [3.0, 1.0])
    assert sum(split) == TINY.num_layers and split[0] > split[1] >= 1
    assert uniform_split(TINY, TINY.num_layers) == (1,) * TINY.num_layers


def test_fixed_option_uniform_split_equal_micro_batches() -> None:
    est = _estimator()
    st = Structure(pool="p", strategy="stage-major", pp=2, dp=2, assignment=((0, 2), (1, 3)),
                   micro_batch_size=1)
    option = memory_option(3, buckets=8, recompute=True)
    candidate = builder.build(est, st, "1f1b", split=split_rules.uniform, memory=memory_rules.fixed(option),
                              micro_batches=builder.equal_micro_batches(), estimate=builder.no_estimate)
    assert candidate is not None
    assert candidate.stage_layers == uniform_split(TINY, 2)
    assert candidate.options == (option, option)
    assert candidate.micro_batches == (8, 8) and candidate.estimate_s == 0.0
    layout = candidate.layout(TINY, 128)
    assert layout.num_stages == 2 and all(z.level == 3 for z in layout.zero)


def test_planner_and_interleaved_candidates_are_build_configurations() -> None:
    est = _estimator()
    st = next(s for s in est.structures({"all": [0, 1, 2, 3]}, max_pp=2, micro_batch_sizes=[1]) if s.pp == 2)
    base = est.candidate(st, "1f1b")
    assert base is not None and sum(base.micro_batches) == 16 and base.estimate_s > 0
    interleaved = est.candidate(st, "interleaved", virtual_stages=2)
    assert interleaved is not None
    assert interleaved.knobs == {"virtual_stages": 2}
    assert interleaved.micro_batches == base.micro_batches
    assert len(interleaved.stage_layers) == 4 and sum(interleaved.stage_layers) == TINY.num_layers
