"""The planner's exact stage check and the compiler book the same memory for a recomputing stage:
model state, the kept inputs of every in-flight micro-batch, and once the largest block's forward
activations, which its backward holds again."""

from __future__ import annotations

from dataclasses import replace

import pytest

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.tp_cost import TensorPricing
from medley.cost.zero_memory import stage_state_bytes, state_bytes_per_param
from medley.lowering.compile import backward_workspace, compile_problem, recompute_workspace
from medley.plan.layout import PlanLayout
from medley.schedule.zero_settings import StageZero
from medley.search.estimate.bounds import stage_memory
from medley.search.estimate.layer_table import layer_table
from medley.search.space import memory_option
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

MODEL = get_model("llama-2-7b")
MBS, SEQ = 1, 1024


def _table():
    cluster = parse_cluster_arg("1xA100-80GB")
    cost = CatalogCostSource.for_cluster(MODEL, cluster)
    return layer_table(MODEL, cost, device_type="A100-80GB", micro_batch_size=MBS, seq_len=SEQ, dtype="bf16",
                       tensor=TensorPricing(MODEL, cost, cluster).of("bf16"))


@pytest.mark.parametrize(("i", "j"), [(1, 5), (0, 3), (30, 34)])
def test_recompute_adds_the_largest_blocks_activations_once(i: int, j: int) -> None:
    table = _table()
    plain = stage_memory(table, i, j, option=memory_option(0), dp=1, in_flight=3.0)
    rc = stage_memory(table, i, j, option=memory_option(0, recompute=True), dp=1, in_flight=3.0)
    state = stage_state_bytes(table.params[j] - table.params[i], level=0, dp=1,
                              per_param=state_bytes_per_param("bf16")).peak
    full = [formulas.layer_activation_bytes(MODEL, k, micro_batch_size=MBS, seq_len=SEQ, dtype_bytes=2)
            for k in range(i, j)]
    kept = [formulas.layer_activation_bytes(MODEL, k, micro_batch_size=MBS, seq_len=SEQ, dtype_bytes=2,
                                            recompute=True) for k in range(i, j)]
    # bf16 at level 0 computes from autocast's copies of the fp32 weights: 2 B per cast parameter
    # per micro-batch in flight, none inside recomputing blocks.
    copies = [2.0 * formulas.layer_autocast_params(MODEL, k) for k in range(i, j)]
    kept_copies = [c if MODEL.layer_kind(k) != "block" else 0.0
                   for k, c in zip(range(i, j), copies, strict=True)]
    assert plain == pytest.approx(state + 3.0 * (sum(full) + sum(copies)))
    # The backward runs from the last layer: a block reruns its forward after the layers behind
    # it freed what a split B frees of theirs (the head: its activations beyond what W needs).
    after_b = [table.after_b[k + 1] - table.after_b[k] for k in range(i, j)]
    freed = [max(0.0, k - a) for k, a in zip(kept, after_b, strict=True)]
    rerun = max(f - k - sum(freed[n + 1:]) for n, (f, k) in enumerate(zip(full, kept, strict=True)))
    assert rc == pytest.approx(state + 3.0 * (sum(kept) + sum(kept_copies)) + max(0.0, rerun))


def test_the_compiler_books_the_same_transient() -> None:
    layout = PlanLayout(model=MODEL, pp=1, dp=1, assignment=((0,),), stage_layers=(MODEL.num_layers,),
                        schedule="1f1b", micro_batches=(2,), micro_batch_size=MBS, seq_len=SEQ,
                        zero=(StageZero(level=0),), recompute=(True,), dtype="bf16")
    cluster = parse_cluster_arg("1xA100-80GB")
    cost = CatalogCostSource.for_cluster(MODEL, cluster)
    table = _table()
    rerun = max(recompute_workspace(layout, cost, k, "A100-80GB") for k in range(MODEL.num_layers))
    block = table.act[2] - table.act[1] - (table.act_rc[2] - table.act_rc[1])
    assert rerun == pytest.approx(block) and rerun > 0
    assert backward_workspace(replace(layout, recompute=(False,)), cost, 0, "A100-80GB") == 0.0
    assert backward_workspace(layout, cost, 0, "A100-80GB") == pytest.approx(rerun)
    # The last block's backward runs after the head's has freed the head's activations (1F1B
    # runs BW: all of them; the planner's bound counts what a split B frees, no more).
    head = MODEL.num_layers - 1
    head_act = formulas.layer_activation_bytes(MODEL, head, micro_batch_size=MBS, seq_len=SEQ, dtype_bytes=2)
    compiled = compile_problem(layout, cluster, cost).stage_costs[0][0].workspace_bytes
    assert compiled == pytest.approx(max(0.0, rerun - head_act))
    state = stage_state_bytes(table.params[-1], level=0, dp=1, per_param=state_bytes_per_param("bf16")).peak
    bound = stage_memory(table, 0, MODEL.num_layers, option=memory_option(0, recompute=True), dp=1,
                         in_flight=0.0) - state
    assert compiled <= bound <= rerun
