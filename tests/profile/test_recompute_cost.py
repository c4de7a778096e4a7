"""Recomputation's time enters the simulated stage costs exactly: a recomputing stage pays its
blocks' forward again in every backward call that needs their activations."""

from __future__ import annotations

from pathlib import Path

import pytest

from medley.cost import formulas
from medley.cost.interfaces import Pass
from medley.cost.profile_format import load_profile
from medley.cost.profiles import ProfileCostSource
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.spec.catalog import CPU_DEVICE_TYPE
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model_arg import get_model

PROFILE = Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json"
TINY = get_model("tiny")


def _costs(schedule: str, pp: int, split: str, recompute: bool) -> list[tuple[float, float, float]]:
    profile = load_profile(PROFILE).model_copy(update={"overhead": None})
    cost = ProfileCostSource(profile=profile, name=PROFILE.name, model=TINY)
    nodes = [{"name": "cpus", "device": CPU_DEVICE_TYPE, "count": pp}]
    cluster = cluster_from_dict({"name": "cpus", "nodes": nodes}, source="test")
    layout = inline_layout(
        cluster=cluster, model=TINY, cost=cost, pp=pp, dp=1, schedule=schedule, micro_batches="2",
        micro_batch_size=1, seq_len=128, zero=",".join(["0"] * pp), split=split, dtype="fp32",
        recompute=recompute,
    )
    problem = compile_problem(layout, cluster, cost)
    return [(c.forward_s, c.backward_input_s, c.backward_weight_s) for c in problem.stage_costs[0]]


def _block_forward(layers: range) -> float:
    profile = load_profile(PROFILE)
    cost = ProfileCostSource(profile=profile, name=PROFILE.name, model=TINY)
    return sum(cost.layer_time(layer, Pass.F, micro_batch_size=1, seq_len=128,
                               device_type=CPU_DEVICE_TYPE).seconds
               for layer in layers if TINY.layer_kind(layer) == "block")


def test_fused_backward_reruns_the_blocks_forward_once() -> None:
    """1F1B's fused backward: +1 forward of the blocks, not scaled away by the fused measurement."""
    (f0, b0, w0), = _costs("1f1b", 1, "6", False)
    (f1, b1, w1), = _costs("1f1b", 1, "6", True)
    assert f1 == f0
    assert (b1 + w1) - (b0 + w0) == pytest.approx(_block_forward(range(6)), rel=1e-9)


def test_split_backward_reruns_it_in_b_and_in_w() -> None:
    """ZB-H1: past the first stage B and W are two autograd calls and each recomputes; the first
    stage's split backward is one call (at W) and recomputes once."""
    plain, again = _costs("zb-h1", 2, "2,4", False), _costs("zb-h1", 2, "2,4", True)
    first, last = _block_forward(range(0, 2)), _block_forward(range(2, 6))
    assert again[0][2] - plain[0][2] == pytest.approx(first, rel=1e-9) and again[0][1] == plain[0][1] == 0
    assert again[1][1] - plain[1][1] == pytest.approx(last, rel=1e-9)
    assert again[1][2] - plain[1][2] == pytest.approx(last, rel=1e-9)



def test_recomputing_stage_keeps_measured_bytes_of_embedding_and_head() -> None:
    """Only blocks recompute: they keep their input (the formula), the head keeps what the
    profile measured, and the last block's output, the head's input, which neither counts (a
    measured layer counts its output, the formula a block's input), is held on top."""
    profile = load_profile(PROFILE)
    cost = ProfileCostSource(profile=profile, name=PROFILE.name, model=TINY)
    nodes = [{"name": "cpus", "device": CPU_DEVICE_TYPE, "count": 2}]
    cluster = cluster_from_dict({"name": "cpus", "nodes": nodes}, source="test")
    layout = inline_layout(
        cluster=cluster, model=TINY, cost=cost, pp=2, dp=1, schedule="1f1b", micro_batches="2",
        micro_batch_size=1, seq_len=128, zero="0,0", split="2,4", dtype="fp32", recompute=True,
    )
    last = compile_problem(layout, cluster, cost).stage_costs[0][1]
    kept = sum(formulas.layer_activation_bytes(TINY, layer, micro_batch_size=1, seq_len=128, dtype_bytes=4,
                                               recompute=True) for layer in range(2, 5))
    head = cost.activation_bytes(5, micro_batch_size=1, seq_len=128, device_type=CPU_DEVICE_TYPE)
    assert TINY.layer_kind(5) == "head" and head is not None
    boundary = formulas.boundary_bytes(TINY, micro_batch_size=1, seq_len=128, dtype_bytes=4)
    assert last.activation_bytes == pytest.approx(kept + head[0] + boundary, rel=1e-12)
