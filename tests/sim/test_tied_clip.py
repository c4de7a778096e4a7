"""The tied embeddings' gradient sum in the simulator: the CLIP collective of a plan whose tied
weight has two copies lasts the norm's all-reduce plus the slowest replica's tied all-reduce."""

from __future__ import annotations

from dataclasses import replace

from medley.cost.comm import TopologyCommModel
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Collective
from medley.cost.zero_memory import state_bytes_per_param
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.schedule.ir import Kind
from medley.sim.engine import simulate
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


def _clip_span(tied: bool, *, zero: str, pp: int = 2, virtual: int = 1, split: str | None = None) -> tuple:
    cluster = parse_cluster_arg("2xA100-80GB+2xV100-32GB")
    model = replace(get_model("llama-2-7b"), tied_embeddings=tied)
    cost = CatalogCostSource.for_cluster(model, cluster)
    layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=pp, dp=4 // pp, schedule="interleaved"
                           if virtual > 1 else "1f1b", virtual_stages=virtual, micro_batches="4",
                           micro_batch_size=1, seq_len=1024, zero=zero, split=split, clip_grad=True)
    result = simulate(compile_problem(layout, cluster, cost))
    start, end = next((s, e) for _, s, e, a in result.collectives if a.kind is Kind.CLIP)
    return end - start, layout, cluster


def test_the_clip_of_a_tied_pipeline_lasts_the_tied_all_reduce_longer() -> None:
    tied, layout, cluster = _clip_span(True, zero="0,0")
    untied, _, _ = _clip_span(False, zero="0,0")
    comm = TopologyCommModel(cluster)
    grad = state_bytes_per_param(layout.dtype).grads * layout.model.vocab_size * layout.model.hidden_size
    pairs = [(row[0], row[-1]) for row in layout.assignment]
    want = max(comm.collective_time(Collective.ALL_REDUCE, pair, grad) for pair in pairs)
    assert want > 0 and abs((tied - untied) - want) <= 1e-9 * want


def test_a_sharded_end_sums_rows_and_one_device_holding_both_ends_costs_nothing() -> None:
    sharded, _, _ = _clip_span(True, zero="3,3")
    full, _, _ = _clip_span(True, zero="0,0")
    assert sharded < full  # each replica sums its shard's rows only
    same, _, _ = _clip_span(True, zero="0,0", pp=1, virtual=2, split="17,17")
    untied, _, _ = _clip_span(False, zero="0,0", pp=1, virtual=2, split="17,17")
    assert same == untied
