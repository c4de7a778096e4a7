"""The runtime's measured overhead enters the prediction exactly: per compute action on the
stage's compute, per point-to-point transfer on the transfer (closed forms on tiny plans)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medley.cost.comm import TopologyCommModel
from medley.cost.profile_format import OverheadProfile, load_profile
from medley.cost.profiles import ProfileCostSource
from medley.lowering.compile import compile_problem
from medley.lowering.predict import predict
from medley.plan.inline import inline_layout
from medley.spec.catalog import CPU_DEVICE_TYPE
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model_arg import get_model

PROFILE = Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json"
TINY = get_model("tiny")


def _cluster(devices: int) -> Cluster:
    nodes = [{"name": "cpus", "device": CPU_DEVICE_TYPE, "count": devices}]
    return cluster_from_dict({"name": "cpus", "nodes": nodes}, source="test")


def _cost(action_s: float | None, handoff_s: float = 0.0) -> ProfileCostSource:
    profile = load_profile(PROFILE).model_copy(update={"overhead": None})
    if action_s is not None:
        overhead = OverheadProfile(action_s=action_s, p2p_handoff_s=handoff_s)
        profile = profile.model_copy(update={"overhead": overhead})
    return ProfileCostSource(profile=profile, name=PROFILE.name, model=TINY)


@pytest.mark.parametrize(("schedule", "actions_per_micro_batch"), [("1f1b", 2), ("zb-h1", 3)])
def test_one_stage_step_grows_by_overhead_times_actions(schedule: str, actions_per_micro_batch: int) -> None:
    """One stage on one device runs its actions back to back: F and BW per micro-batch under
    1F1B, F, B and W under ZB-H1 (the first stage's B is empty but still an action)."""
    cluster, micro_batches, overhead = _cluster(1), 4, 1.5e-3
    steps = []
    for action_s in (None, overhead):
        cost = _cost(action_s)
        layout = inline_layout(
            cluster=cluster,
            model=TINY,
            cost=cost,
            pp=1,
            dp=1,
            schedule=schedule,
            micro_batches=str(micro_batches),
            micro_batch_size=1,
            seq_len=128,
            zero="0",
            dtype="fp32",
        )
        steps.append(predict(layout, cluster, cost=cost)[0].step_time_s)
    assert steps[1] - steps[0] == pytest.approx(overhead * actions_per_micro_batch * micro_batches, rel=1e-9)


def test_transfers_carry_the_hand_off() -> None:
    cluster = _cluster(2)
    base = TopologyCommModel(cluster)
    assert TopologyCommModel(cluster, p2p_overhead_s=2e-4).p2p_time(0, 1, 4096.0) == pytest.approx(
        base.p2p_time(0, 1, 4096.0) + 2e-4
    )
    assert TopologyCommModel(cluster, p2p_overhead_s=2e-4).p2p_time(1, 1, 4096.0) == 0.0  # no transfer
    cost = _cost(0.0, handoff_s=2e-4)
    layout = inline_layout(
        cluster=cluster,
        model=TINY,
        cost=cost,
        pp=2,
        dp=1,
        schedule="1f1b",
        micro_batches="1",
        micro_batch_size=1,
        seq_len=128,
        split="2,2",
        zero="0,0",
        dtype="fp32",
    )
    problem = compile_problem(layout, cluster, cost)
    assert isinstance(problem.comm, TopologyCommModel) and problem.comm.p2p_overhead_s == 2e-4
    # One micro-batch through two stages: the forward and the gradient each cross once, serially.
    without = predict(layout, cluster, cost=_cost(0.0))[0].step_time_s
    assert predict(layout, cluster, cost=cost)[0].step_time_s - without == pytest.approx(2 * 2e-4, rel=1e-6)


def test_profiles_without_overhead_load_and_predict_none(tmp_path: Path) -> None:
    """A profile written before the overhead was measured has no ``overhead`` field."""
    raw = json.loads(PROFILE.read_text())
    raw.pop("overhead", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    source = ProfileCostSource(profile=load_profile(old), name="old.json", model=TINY)
    assert source.profile.overhead is None
    assert (
        source.action_overhead_time(device_type=CPU_DEVICE_TYPE) is None
        and source.p2p_overhead_time() is None
    )


def test_each_zero_gather_and_reduction_carries_the_measured_call_overhead() -> None:
    """Streamed ZeRO-3 on one stage puts every gather and reduction between two compute actions
    (each compute waits for its gathers, which queue behind the previous reductions), so the step
    grows by the overhead times the gathers and reductions of the step: a gather per bucket per
    compute action, a reduction per bucket per backward (with clipping, the optimizer steps wait
    for every reduction)."""
    cluster, micro_batches, buckets, overhead = _cluster(2), 3, 3, 2e-3
    steps = []
    for collective_s in (0.0, overhead):
        profile = load_profile(PROFILE).model_copy(update={
            "overhead": OverheadProfile(action_s=0.0, p2p_handoff_s=0.0, collective_s=collective_s)})
        cost = ProfileCostSource(profile=profile, name=PROFILE.name, model=TINY)
        layout = inline_layout(
            cluster=cluster, model=TINY, cost=cost, pp=1, dp=2, schedule="1f1b",
            micro_batches=f"{micro_batches},{micro_batches}", micro_batch_size=1, seq_len=128, zero="3",
            buckets=buckets, gather_windows=0, dtype="fp32", clip_grad=True,
        )
        steps.append(predict(layout, cluster, cost=cost)[0].step_time_s)
    calls = 3 * micro_batches * buckets  # per micro-batch and bucket: F and BW gather, BW reduces
    assert steps[1] - steps[0] == pytest.approx(overhead * calls, rel=1e-9)
