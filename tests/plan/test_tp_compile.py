"""A plan with tensor parallelism compiled and simulated: one TP rank's times with the all-reduces
inside, one rank's memory on every device of the group, transfers between groups of different
degree, DP collectives over the lead's group, and tp shown in the trace and the Gantt chart."""

from __future__ import annotations

import dataclasses
import json

import pytest

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Collective, Pass
from medley.cost.tp_cost import TensorParallelCompute, tp_comm_time
from medley.cost.zero_memory import state_bytes_per_param
from medley.lowering.compile import compile_problem, static_memory
from medley.lowering.predict import predict
from medley.plan.inline import inline_layout
from medley.plan.layout import PlanLayout
from medley.schedule.ir import Action, Kind
from medley.sim.gantt import write_gantt
from medley.sim.trace import write_chrome_trace
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

MODEL = get_model("llama-2-7b")


def _layout(cluster_arg: str = "8xA100-80GB", **changes) -> tuple[PlanLayout, object, CatalogCostSource]:
    cluster = parse_cluster_arg(cluster_arg)
    cost = CatalogCostSource.for_cluster(MODEL, cluster)
    layout = inline_layout(cluster=cluster, model=MODEL, cost=cost, pp=2, dp=1, schedule="1f1b",
                           micro_batches="4", micro_batch_size=1, seq_len=2048, split="16,16", zero="0,0")
    return dataclasses.replace(layout, **changes), cluster, cost


def test_a_tp_stage_times_one_rank_and_its_all_reduces() -> None:
    layout, cluster, cost = _layout(assignment=((0, 2),), tp=(2, 1))
    problem = compile_problem(layout, cluster, cost)
    tensor = TensorParallelCompute(MODEL, cost, catalog=cost)
    comm = TopologyCommModel(cluster)
    at = {"micro_batch_size": 1, "seq_len": 2048}
    for kind, got in ((Pass.F, problem.stage_costs[0][0].forward_s),
                      (Pass.W, problem.stage_costs[0][0].backward_weight_s)):
        want = sum(tensor.layer_time(i, kind, tp=2, device_type="A100-80GB", **at)
                   + tp_comm_time(comm, MODEL, i, kind, group=(0, 1), dtype="bf16", **at)
                   for i in layout.layer_range(0))
        assert got == pytest.approx(want)
    blocks = 16
    ring = 2 * (2e-6 + 0.5 * 2048 * MODEL.hidden_size * 2 / 300e9)  # one all-reduce over 2 NVLink ports
    whole_f = sum(cost.layer_time(i, Pass.F, device_type="A100-80GB", **at).seconds
                  for i in layout.layer_range(0))
    assert problem.stage_costs[0][0].forward_s > whole_f / 2 + 2 * blocks * ring * 0.999
    # The tp-1 stage is as before.
    plain, _, _ = _layout(assignment=((0, 2),))
    assert problem.stage_costs[0][1].forward_s == pytest.approx(
        compile_problem(plain, cluster, cost).stage_costs[0][1].forward_s)


def test_memory_per_device_halves_the_split_parts_only() -> None:
    tp2, cluster, cost = _layout(assignment=((0, 2),), tp=(2, 1))
    tp1, _, _ = _layout(assignment=((0, 2),))
    state = state_bytes_per_param("bf16")
    # Level 0 bf16 holds the fp32 master (in the optimizer's 12 B) and computes from autocast's
    # copies; the gradient is the backward's, not static.
    per_param = state.optimizer
    two, one = static_memory(tp2, (0, 1)), static_memory(tp1, (0, 1))
    layers = tp2.layer_range(0)
    replicated = formulas.layer_params(MODEL, 0) + 16 * 2 * MODEL.hidden_size  # embedding, norms
    split = formulas.stage_held_params(MODEL, layers.start, layers.stop) - replicated
    assert one[0] == pytest.approx((replicated + split) * per_param)
    assert two[0] == two[1] == pytest.approx((replicated + split / 2) * per_param)
    assert two[2] == pytest.approx(one[2])
    prediction, problem, result = predict(tp2, cluster, cost=cost)
    assert sorted(prediction.peak_memory_gb) == sorted(tp2.devices) == [0, 1, 2]
    assert prediction.peak_memory_gb[0] == prediction.peak_memory_gb[1]
    # Activations of the tp-2 stage are one rank's: less than the tp-1 plan's on device 0.
    plain = predict(tp1, cluster, cost=cost)[0]
    assert prediction.peak_memory_gb[0] < plain.peak_memory_gb[0]
    whole = compile_problem(tp1, cluster, cost).stage_costs[0][0]
    assert problem.stage_costs[0][0].activation_bytes < whole.activation_bytes
    assert [r.device for r in result.devices] == [0, 1, 2]


def test_transfers_between_groups_load_the_busiest_link() -> None:
    layout, cluster, cost = _layout(assignment=((0, 2),), tp=(2, 1))
    problem = compile_problem(layout, cluster, cost)
    boundary = formulas.boundary_bytes(MODEL, micro_batch_size=1, seq_len=2048)
    # Forward: one receiver; backward: device 2 feeds both TP ranks over its one NVLink port.
    assert problem.stage_costs[0][0].send_bytes == boundary
    assert problem.stage_costs[0][0].send_back_bytes == 2 * boundary
    across, cluster2, cost2 = _layout("2xA100-80GB+2xA100-80GB", assignment=((0, 2),), tp=(2, 1))
    problem = compile_problem(across, cluster2, cost2)
    # Across nodes both receivers' gradients go through device 2's node network: twice the bytes.
    assert problem.stage_costs[0][0].send_bytes == boundary
    assert problem.stage_costs[0][0].send_back_bytes == 2 * boundary


def test_a_hop_between_groups_of_one_degree_sends_slices_and_gathers_them() -> None:
    """Megatron's scatter-gather: each of the t transfers is a 1/t slice, so the node network
    carries the tensor once (was t times) and a device link inside a node 1/t of it; the receiving
    group's all-gather joins the forward that uses the activation and the backward that uses the
    gradient."""
    boundary = formulas.boundary_bytes(MODEL, micro_batch_size=1, seq_len=2048)
    # (cluster, degree, first device of the second group, bytes on the hop's busiest link)
    for cluster_arg, tp, second, link_bytes in (("2xA100-80GB+2xA100-80GB", 2, 2, boundary),
                                                ("8xA100-80GB+8xA100-80GB", 4, 8, boundary),
                                                ("8xA100-80GB", 2, 2, boundary / 2),
                                                ("2xA100-80GB+2xV100-32GB", 2, 2, boundary)):
        layout, cluster, cost = _layout(cluster_arg, assignment=((0, second),), tp=(tp, tp))
        problem = compile_problem(layout, cluster, cost)
        plain = compile_problem(layout, cluster, cost, comm=False)  # no TP communication at all
        comm = TopologyCommModel(cluster)
        row, bare = problem.stage_costs[0], plain.stage_costs[0]
        assert row[0].send_bytes == row[0].send_back_bytes == link_bytes, cluster_arg
        receivers = tuple(range(second, second + tp))
        gather = comm.collective_time(Collective.ALL_GATHER, receivers, boundary)
        assert gather > 0
        tp_f = sum(tp_comm_time(comm, MODEL, i, Pass.F, group=receivers, micro_batch_size=1,
                                seq_len=2048, dtype="bf16") for i in layout.layer_range(1))
        assert row[1].forward_s == pytest.approx(bare[1].forward_s + tp_f + gather, rel=1e-12)
        back = comm.collective_time(Collective.ALL_GATHER, tuple(range(tp)), boundary)
        tp_b = sum(tp_comm_time(comm, MODEL, i, Pass.B, group=tuple(range(tp)), micro_batch_size=1,
                                seq_len=2048, dtype="bf16") for i in layout.layer_range(0))
        assert row[0].backward_input_s == pytest.approx(bare[0].backward_input_s + tp_b + back, rel=1e-12)
        if "V100" in cluster_arg:  # each gather is timed on its receiving group's own links
            assert gather != pytest.approx(back)


def test_dp_collectives_of_a_tp_stage_reduce_a_rank_shard_sharing_the_node_network() -> None:
    layout, cluster, cost = _layout("4xA100-80GB+4xA100-80GB", dp=2, assignment=((0, 2), (4, 6)),
                                    tp=(2, 2), micro_batches=(2, 2), zero=layout_zero(1))
    problem = compile_problem(layout, cluster, cost)
    reduce = problem.collectives(0, Action(kind=Kind.REDUCE_GRAD, stage=0))
    layers = layout.layer_range(0)
    shard = formulas.stage_held_params(MODEL, layers.start, layers.stop, tp=2)
    assert reduce.group == (0, 4) and reduce.op is Collective.REDUCE_SCATTER
    assert reduce.nbytes == pytest.approx(2 * shard * state_bytes_per_param("bf16").grads)
    inside, cluster1, cost1 = _layout("8xA100-80GB", dp=2, assignment=((0, 4), (2, 6)), tp=(2, 2),
                                      micro_batches=(2, 2), zero=layout_zero(1))
    reduce = compile_problem(inside, cluster1, cost1).collectives(0, Action(kind=Kind.REDUCE_GRAD, stage=0))
    assert reduce.nbytes == pytest.approx(shard * state_bytes_per_param("bf16").grads)


def layout_zero(level: int) -> tuple:
    from medley.schedule.zero_settings import StageZero

    return (StageZero(level=level), StageZero(level=level))


def test_trace_and_gantt_name_the_tp_ranks(tmp_path) -> None:
    layout, cluster, cost = _layout(assignment=((0, 2),), tp=(2, 1))
    _, _, result = predict(layout, cluster, cost=cost)
    events = json.loads(write_chrome_trace(result, tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[1] == "device 1 (replica 0, rank 0, tp rank 1 of 2)"
    assert names[2] == "device 2 (replica 0, rank 1)"
    assert result.compute[1] == result.compute[0]
    assert [r.label for r in result.devices] == ["r0 k0 tp0/2", "r0 k0 tp1/2", "r0 k1"]
    assert write_gantt(result, tmp_path / "g.png").stat().st_size > 0
    # MFU counts every device's peak, the members' too.
    assert result.mfu == pytest.approx(
        layout_flops(layout) / (result.step_time_s * 3 * cluster.devices[0].type.peak_flops("bf16")))


def layout_flops(layout: PlanLayout) -> float:
    sequences = sum(layout.micro_batches)
    return formulas.megatron_flops_per_step(MODEL, batch_size=sequences, seq_len=layout.seq_len)


def test_a_two_direction_schedule_gives_each_stage_its_ranks_degree() -> None:
    layout, cluster, cost = _layout(assignment=((0, 2),), tp=(2, 1), schedule="bidirectional",
                                    stage_layers=(17, 17, 17, 17), zero=layout_zero(0) * 2,
                                    recompute=(False,) * 4)
    problem = compile_problem(layout, cluster, cost)
    assert problem.schedules[0].stage_to_rank == (0, 1, 1, 0)
    assert [layout.stage_tp(s) for s in range(4)] == [2, 1, 1, 2]
    static = static_memory(layout, problem.schedules[0].stage_to_rank)
    assert static[0] == static[1] and static[0] < static[2]
