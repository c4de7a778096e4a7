"""DTensor's dispatch overhead, measured per block (profile ``tp_*`` fields), enters a TP stage's
compute exactly: once per block per pass, split between B and W like the backward, and only on
stages with tp > 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from medley.cost.profile_format import load_profile
from medley.cost.profiles import ProfileCostSource
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.spec.catalog import CPU_DEVICE_TYPE
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model_arg import get_model

PROFILE = Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json"
TINY = get_model("tiny")


def _stage_costs(extra_f: float, extra_bw: float, tp: str) -> tuple[float, float]:
    profile = load_profile(PROFILE).model_copy(update={"overhead": None})
    layers = [m.model_copy(update={"tp_forward_s": m.forward_s + extra_f,
                                   "tp_backward_full_s": m.backward_full_s + extra_bw})
              if m.kind == "block" else m for m in profile.layers]
    cost = ProfileCostSource(profile=profile.model_copy(update={"layers": layers}), name=PROFILE.name,
                             model=TINY)
    nodes = [{"name": "cpus", "device": CPU_DEVICE_TYPE, "count": 2}]
    cluster = cluster_from_dict({"name": "cpus", "nodes": nodes}, source="test")
    layout = inline_layout(cluster=cluster, model=TINY, cost=cost, pp=1, dp=1, schedule="1f1b",
                           micro_batches="2", micro_batch_size=2, seq_len=128, zero="0", dtype="fp32", tp=tp)
    stage = compile_problem(layout, cluster, cost, comm=False).stage_costs[0][0]
    return stage.forward_s, stage.backward_input_s + stage.backward_weight_s


@pytest.mark.parametrize("tp", ["1", "2"])
def test_dtensor_overhead_is_added_per_block_on_tp_stages(tp: str) -> None:
    blocks = sum(1 for layer in range(TINY.num_layers) if TINY.layer_kind(layer) == "block")
    base_f, base_bw = _stage_costs(0.0, 0.0, tp)
    more_f, more_bw = _stage_costs(1e-3, 3e-3, tp)
    expected = (blocks * 1e-3, blocks * 3e-3) if tp == "2" else (0.0, 0.0)
    assert more_f - base_f == pytest.approx(expected[0], abs=1e-12)
    assert more_bw - base_bw == pytest.approx(expected[1], abs=1e-12)
