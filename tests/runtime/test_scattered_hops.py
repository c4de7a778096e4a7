"""Pipeline hops between TP groups of one degree carry slices, as Megatron-LM scatters and gathers
pipeline tensors (:func:`medley.plan.layout.tp_scattered`): on tp2 x pp2 each rank sends half of
every activation and gradient (fp32 and bf16), its group all-gathers what it receives, and the simulator's hop
bytes are the runtime's: the busiest link inside a node carries one slice per message, and the
all-gathers the compiler adds to the compute actions move the whole tensor. That such plans train
as one process does is test_tp_equality's tp2xpp2 cases."""

from __future__ import annotations

import pytest
from equality_worker import MBS, SEQ, Case
from test_equality import launch
from zero_bytes_worker import count_hops

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.formulas import DTYPE_BYTES
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

MICRO_BATCHES = 3


def _case(dtype: str) -> tuple[Case, float, float]:
    """The tp2 x pp2 case in ``dtype`` (activations go in the compute dtype), the compiler's bytes
    on the hop's busiest link and the whole tensor's bytes."""
    model = get_model("tiny")
    cluster = parse_cluster_arg("4xA100-80GB")
    cost = CatalogCostSource.for_cluster(model, cluster)
    layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=2, dp=1, schedule="1f1b",
                           micro_batches=str(MICRO_BATCHES), micro_batch_size=MBS, seq_len=SEQ,
                           zero="0,0", tp="2,2", dtype=dtype)
    problem = compile_problem(layout, cluster, cost)
    whole = formulas.boundary_bytes(model, micro_batch_size=MBS, seq_len=SEQ, dtype_bytes=DTYPE_BYTES[dtype])
    hop = problem.stage_costs[0][0]
    assert hop.send_bytes == hop.send_back_bytes == whole / 2
    case = Case(name=f"tp2xpp2-hops-{dtype}", pp=2, dp=1, split=layout.stage_layers, zero=(0, 0), tp=(2, 2),
                schedules=problem.schedules, table=(((0, 1), (2, 3)),), dtype=dtype)
    return case, hop.send_bytes, whole


@pytest.mark.timeout(300)
def test_a_tp2_hop_sends_half_of_each_tensor_and_gathers_it(tmp_path) -> None:
    cases = {dtype: _case(dtype) for dtype in ("fp32", "bf16")}
    results = launch(4, [case for case, _, _ in cases.values()], tmp_path, body=count_hops)
    for case, link_bytes, whole in cases.values():
        got = results[case.name]
        assert "error" not in got, got["error"]
        for rank in range(4):
            # Stage 0 sends activations and gathers gradients; stage 1 the other way round.
            assert got[f"rank{rank}.send"] == MICRO_BATCHES * link_bytes, (case.name, got)
            assert got[f"rank{rank}.all_gather"] == MICRO_BATCHES * whole, (case.name, got)
