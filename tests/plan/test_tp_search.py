"""Tensor parallelism in the planner: TP groups of a device pool, the planner's tables booking what
the compiler books at tp, and the joint search choosing tp where it pays."""

from __future__ import annotations

import pytest

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.estimator import CatalogCostSource
from medley.lowering.compile import compile_problem
from medley.lowering.tp_links import gather_time
from medley.plan.layout import check_tp
from medley.schedule.ir import Kind
from medley.search import planner as search_module
from medley.search.estimate.bounds import Flight, stage_memory
from medley.search.planner import search
from medley.search.rank import ranking
from medley.search.rules.builder import build, given_micro_batches
from medley.search.rules.candidates import Estimator
from medley.search.rules.memory_rules import fixed
from medley.search.rules.tp_structures import tp_degrees, tp_groups
from medley.search.space import MemoryOption, Structure, memory_option
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


def _estimator(cluster_arg: str, model: str = "llama-2-7b", *, global_batch: int = 16,
               seq_len: int = 1024) -> Estimator:
    cluster = parse_cluster_arg(cluster_arg)
    spec = get_model(model)
    return Estimator(cluster, spec, CatalogCostSource.for_cluster(spec, cluster), seq_len=seq_len,
                     global_batch=global_batch, memory_headroom=0.05)


def test_tp_groups_are_whole_runs_on_one_node_of_one_type() -> None:
    est = _estimator("4xA100-80GB+2xV100-32GB")  # node 0: ids 0-3 (A100), node 1: ids 4-5 (V100)
    devices = list(range(6))
    assert tp_groups(est, devices, 1) == devices
    assert tp_groups(est, devices, 2) == [0, 2, 4]
    assert tp_groups(est, devices, 4) == [0]
    assert tp_groups(est, [0, 1, 3, 4, 5], 2) == [0, 4]  # 3 has no partner on its node
    assert tp_degrees(est, devices) == (1, 2, 4)
    structures = list(est.structures({"all": devices}, max_pp=4, micro_batch_sizes=(1,), mixed_tp=True))
    assert {st.tp[:1] for st in structures} == {(), (2,), (4,)}
    for st in structures:
        groups = [range(st.assignment[r][k], st.assignment[r][k] + st.tp_of(k))
                  for r in range(st.dp) for k in range(st.pp)]
        used = [d for g in groups for d in g]
        assert len(used) == len(set(used)) == st.num_devices <= 6
        for g in groups:
            assert len({(est.cluster.devices[d].node, est.cluster.devices[d].type.name) for d in g}) == 1
    # Mixed degrees: the A100 and V100 ranks of one replica at different degrees.
    mixed = {st.tp for st in structures if len(set(st.tp)) > 1}
    assert mixed and all(len(tp) == 2 for tp in mixed)


def test_tp_degrees_divide_the_model() -> None:
    est = _estimator("8xA100-80GB", "tiny")
    model = est.model
    assert all(model.num_heads % t == 0 and model.num_kv_heads % t == 0 for t in tp_degrees(est, range(8)))


@pytest.mark.parametrize("option", [memory_option(0), memory_option(1, recompute=True)])
def test_planner_tables_book_what_the_compiler_books_at_tp(option: MemoryOption) -> None:
    est = _estimator("8xA100-80GB", global_batch=8)
    st = Structure(pool="all", strategy="stage-major", pp=2, dp=2, assignment=((0, 4), (2, 6)),
                   micro_batch_size=1, tp=(2, 2))
    candidate = build(est, st, "gpipe", split=lambda s: (17, 17), memory=fixed(option),
                      micro_batches=given_micro_batches((4, 4)))
    assert candidate is not None
    layout = candidate.layout(est.model, est.seq_len)
    check_tp(layout, est.cluster)
    problem = compile_problem(layout, est.cluster, est.cost)
    table = est.table("A100-80GB", 1, "bf16", 2)
    # Times: the planner's table and the compiler's stage cost (TP all-reduces included), which
    # also all-gathers the input its tp2 group receives in slices from the tp2 stage before it
    # (per hop, not per layer: the planner's estimate leaves it out).
    stage = problem.stage_costs[0][1]
    nbytes = formulas.boundary_bytes(est.model, micro_batch_size=1, seq_len=est.seq_len)
    gather = gather_time(TopologyCommModel(est.cluster), (0, 1), (4, 5), nbytes)
    assert gather > 0
    assert stage.forward_s == pytest.approx(table.forward[34] - table.forward[17] + gather)
    # Memory: GPipe holds every micro-batch; the compiler's static state, activations, gradient,
    # the buffers of the stage's reductions (each bucket's once per step) and the backward's
    # workspace (a recomputing block's activations again) match.
    planned = stage_memory(table, 17, 34, option=option, dp=2, in_flight=Flight(full=4))
    static = problem.static_memory_bytes[4]
    assert problem.static_memory_bytes[5] == static
    row = problem.schedules[0].actions[problem.schedules[0].stage_to_rank[1]]
    reductions = {a.bucket: problem.collectives(0, a).alloc_bytes for a in row
                  if a.kind is Kind.REDUCE_GRAD and a.stage == 1}
    # (Level 0's all-reduce buffers each replace their bucket's gradient: one, the largest, on top.)
    buffers = max(reductions.values()) if option.level == 0 else sum(reductions.values())
    booked = static + 4 * stage.activation_bytes + stage.grad_buffer_bytes + buffers + stage.workspace_bytes
    assert booked == pytest.approx(planned, rel=1e-6)
    whole = est.table("A100-80GB", 1, "bf16", 1)
    assert table.params[34] - table.params[17] < 0.55 * (whole.params[34] - whole.params[17])
    assert table.total[34] - table.total[17] < whole.total[34] - whole.total[17]


def test_the_search_picks_tp_where_a_stage_cannot_hold_whole_layers_fast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Estimate every structure and simulate every chosen candidate, so that tp 1's plans lose in
    # the simulation, not only by their bounds or estimates (which the search skips when they
    # cannot beat its 6th best estimate or lie more than 15% behind the fastest simulated step).
    monkeypatch.setattr(ranking, "SIMULATE_WITHIN", float("inf"))
    monkeypatch.setattr(search_module, "ESTIMATE_RIVALS", 10**9)
    # Partial and selective recomputation make more structures promising: expand and simulate
    # them all, not only the 12 best structures and the 24 best candidates (sequence parallelism
    # lets more tp plans fit too).
    monkeypatch.setattr(search_module, "EXPANDED_STRUCTURES", 10**9)
    monkeypatch.setattr(ranking, "SIMULATED_SMALL", 10**3)
    cluster = parse_cluster_arg("8xA100-80GB")
    model = get_model("llama-2-13b")
    result = search(cluster, model, global_batch=16, seq_len=4096, top=3, baselines=False)
    best = result.best
    layout = best.plan.layout
    assert any(t > 1 for t in layout.tp)
    assert layout.sequence_parallel  # on wherever tp > 1 and seq_len divides (4096 does)
    check_tp(layout, cluster)
    assert sorted(best.prediction.peak_memory_gb) == sorted(layout.devices)
    assert any(any(t > 1 for g in p.plan.groups for t in g.tp) for p in result.simulated)
    assert any(not g.tp for p in result.simulated for g in p.plan.groups)  # tp 1 competed too
