"""The runtime's ZeRO collectives move what the simulator times: for every ZeRO level and dp 2
and 4, the bytes per collective kind of one training step, counted on each rank by wrapping the
``torch.distributed`` calls, equal the simulator's for the same plan (one table,
:mod:`medley.cost.zero_levels`, says what each level does)."""

from __future__ import annotations

import dataclasses

import pytest
from equality_worker import Case
from test_equality import launch
from zero_bytes_worker import count_case

from medley.cost.estimator import CatalogCostSource
from medley.lowering.compile import compile_problem, compile_world
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.schedule.ir import COLLECTIVE_KINDS
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

# (name, pp, dp, zero, micro-batches, buckets, gather windows, dtype)
PLANS = [
    *((f"dp{dp}-zero{level}", 1, dp, str(level), "3,2" if dp == 2 else "2", 1, 1, "fp32")
      for dp in (2, 4) for level in range(4)),
    ("pp2-dp2-zero3,1-buckets2", 2, 2, "3,1", "3,2", 2, 1, "fp32"),
    ("pp2-dp2-zero2,0-buckets2", 2, 2, "2,0", "4", 2, 1, "fp32"),
    ("dp2-zero3-streamed", 1, 2, "3", "3", 2, 0, "fp32"),
    # Half precision: weights gathered in the compute dtype, gradients reduced in the plan's
    # gradient dtype (fp32 for bf16, fp16 for fp16), activations sent in the compute dtype.
    *((f"pp2-dp2-zero{zero}-{dtype}", 2, 2, zero, "3,2", 2, 1, dtype)
      for dtype in ("bf16", "fp16") for zero in ("0,1", "2,3")),
]


def simulated_bytes(pp: int, dp: int, zero: str, micro_batches: str, buckets: int,
                    gather_windows: int, dtype: str) -> tuple[Case, dict[str, float]]:
    """The runtime case of an inline plan and the simulator's bytes per device and kind."""
    cluster = parse_cluster_arg(f"{pp * dp}xA100-80GB")
    model = get_model("tiny")
    cost = CatalogCostSource.for_cluster(model, cluster)
    layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=pp, dp=dp, schedule="1f1b",
                           micro_batches=micro_batches, micro_batch_size=2, seq_len=16, zero=zero,
                           buckets=buckets, gather_windows=gather_windows, dtype=dtype)
    problem = compile_problem(layout, cluster, cost)
    assert problem.collectives is not None
    want: dict[str, float] = {}
    for replica, schedule in enumerate(problem.schedules):
        for rank, row in enumerate(schedule.actions):
            device = layout.assignment[replica][rank]
            for action in row:
                if action.kind not in COLLECTIVE_KINDS:
                    continue
                cost_of = problem.collectives(replica, action)
                if cost_of.op is not None and len(cost_of.group) > 1:
                    key = f"rank{device}.{cost_of.op.value}"
                    want[key] = want.get(key, 0.0) + cost_of.nbytes
    case = Case(name="", pp=pp, dp=dp, split=layout.stage_layers, zero=tuple(z.level for z in layout.zero),
                schedules=problem.schedules, dtype=dtype, tp=layout.tp,
                table=tuple(tuple(layout.group(r, k) for k in range(pp)) for r in range(dp)))
    return case, want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_runtime_collective_bytes_equal_the_simulators(world: int, tmp_path) -> None:
    cases, wants = [], {}
    for name, pp, dp, zero, micro_batches, buckets, windows, dtype in PLANS:
        if pp * dp != world:
            continue
        case, want = simulated_bytes(pp, dp, zero, micro_batches, buckets, windows, dtype)
        case.name = name
        cases.append(case)
        wants[name] = want
    results = launch(world, cases, tmp_path, body=count_case)
    for case in cases:
        got = results.get(case.name, {})
        assert "error" not in got, f"{case.name} failed:\n{got['error']}"
        reported = all(got.get(f"rank{rank}.steps") for rank in range(world))
        assert reported, f"{case.name}: a rank did not report"
        counted = {key: value for key, value in got.items() if not key.endswith(".steps")}
        assert counted == pytest.approx(wants[case.name], rel=1e-12), (
            f"{case.name}: runtime {sorted(counted.items())} vs simulator {sorted(wants[case.name].items())}")
        if case.zero != (0,) * len(case.zero) or case.dp > 1:
            assert counted, f"{case.name}: no collective was counted"


# Replica groups of their own shape: (name, groups as (pp, dp, split, micro-batches) each, ZeRO level)
ASYMMETRIC = [
    ("pp2+pp1", ((2, 1, "2,4", "3"), (1, 1, "6", "2")), level) for level in range(4)
] + [("pp2(2,4)+pp2(4,2)", ((2, 1, "2,4", "4"), (2, 1, "4,2", "2")), 1)]


def asymmetric_bytes(groups: tuple, level: int) -> tuple[Case, dict[str, float]]:
    """The runtime case of replica groups on consecutive devices and the simulator's bytes."""
    total = sum(pp * dp for pp, dp, _, _ in groups)
    cluster = parse_cluster_arg(f"{total}xA100-80GB")
    model = get_model("tiny")
    cost = CatalogCostSource.for_cluster(model, cluster)
    layouts, first = [], 0
    for pp, dp, split, micro_batches in groups:
        layout = inline_layout(cluster=cluster, model=model, cost=cost, pp=pp, dp=dp, schedule="1f1b",
                               micro_batches=micro_batches, micro_batch_size=2, seq_len=16,
                               zero=",".join([str(level)] * pp), split=split, buckets=2, dtype="fp32")
        assignment = tuple(tuple(first + r * pp + k for k in range(pp)) for r in range(dp))
        layouts.append(dataclasses.replace(layout, assignment=assignment))
        first += pp * dp
    plan = Plan(groups=layouts, cluster=cluster)
    problem = compile_world(plan.groups, cluster, cost)
    want: dict[str, float] = {}
    devices = [layout.assignment[r] for layout, r in plan.replicas]
    for replica, schedule in enumerate(problem.schedules):
        for rank, row in enumerate(schedule.actions):
            for action in row:
                if action.kind in COLLECTIVE_KINDS:
                    cost_of = problem.collectives(replica, action)
                    if cost_of.op is not None and len(cost_of.group) > 1:
                        key = f"rank{devices[replica][rank]}.{cost_of.op.value}"
                        want[key] = want.get(key, 0.0) + cost_of.nbytes
    case = Case(name="", pp=1, dp=1, split=(), zero=(), schedules=problem.schedules, groups=plan.groups,
                table=tuple(tuple((d,) for d in row) for row in devices))
    return case, want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3, 4])
def test_asymmetric_collective_bytes_equal_the_simulators(world: int, tmp_path) -> None:
    """Each sync segment's bucket is one collective over its holders: what every rank sends equals
    what the simulator times, at every ZeRO level (3 ranks), and with ranks in two segments each (4)."""
    cases, wants = [], {}
    for name, groups, level in ASYMMETRIC:
        if sum(pp * dp for pp, dp, _, _ in groups) != world:
            continue
        case, want = asymmetric_bytes(groups, level)
        case.name = f"{name}-zero{level}"
        cases.append(case)
        wants[case.name] = want
    results = launch(world, cases, tmp_path, body=count_case)
    for case in cases:
        got = results.get(case.name, {})
        assert "error" not in got, f"{case.name} failed:\n{got['error']}"
        counted = {key: value for key, value in got.items() if not key.endswith(".steps")}
        assert counted, f"{case.name}: no collective was counted"
        assert counted == pytest.approx(wants[case.name], rel=1e-12), (
            f"{case.name}: runtime {sorted(counted.items())} vs simulator {sorted(wants[case.name].items())}")
