"""The emulated CPU cluster: slowed device types, the fitted link, and costs that match the
runtime's emulation (factor = fastest peak / own peak)."""

from __future__ import annotations

from pathlib import Path

import pytest

from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import Collective, Pass
from medley.cost.profile_format import Profile
from medley.fidelity.cases import default_cases
from medley.fidelity.emulate import emulated_cluster
from medley.fidelity.plans import case_groups, describe, emulate, tags
from medley.profile.comm_bench import model_time
from medley.spec.model_arg import get_model

TINY = get_model("tiny")


def test_slowed_types_link_and_costs(tmp_path: Path, profile: Profile) -> None:
    slowdowns = (1.0, 2.0, 1.0, 4.0)
    emulated = emulated_cluster(profile, TINY, slowdowns, directory=tmp_path, profile_name="p.json")
    cluster = emulated.cluster
    names = [d.type.name for d in cluster.devices]
    assert names == ["CPU-x1", "CPU-x2", "CPU-x1", "CPU-x4"]
    # The runtime's emulation stretches each rank by fastest peak / own peak (fp32 here).
    peaks = [d.type.peak_flops("fp32") for d in cluster.devices]
    assert [max(peaks) / p for p in peaks] == pytest.approx([1.0, 2.0, 1.0, 4.0])
    base = emulated.cost.layer_time(1, Pass.F, micro_batch_size=1, seq_len=64, device_type="CPU-x1").seconds
    slow = emulated.cost.layer_time(1, Pass.F, micro_batch_size=1, seq_len=64, device_type="CPU-x4").seconds
    assert slow == pytest.approx(4 * base)
    # Every pair and ring is timed with the profile's fitted α-β.
    comm = TopologyCommModel(cluster)
    fit = profile.comm.link
    assert comm.p2p_time(0, 3, 1e6) == pytest.approx(model_time("send_recv", 2, 1e6, fit))
    assert comm.collective_time(Collective.ALL_REDUCE, (0, 1), 1e6) == pytest.approx(
        model_time("all_reduce", 2, 1e6, fit))
    # The catalog file defines the types; a plan of this cluster stores them whole (no path).
    assert emulated.catalog_path.exists() and "catalog" not in cluster.source_spec
    assert set(cluster.source_spec["device_types"]) == {"CPU-x1", "CPU-x2", "CPU-x4"}


def test_refuses_factors_below_one(tmp_path: Path, profile: Profile) -> None:
    with pytest.raises(ValueError, match="slowdowns must be >= 1"):
        emulated_cluster(profile, TINY, (0.5, 1.0), directory=tmp_path, profile_name="p.json")


@pytest.mark.parametrize(("name", "nodes", "tp"), [
    ("tiny-tp2", [[0, 1]], (2,)),
    ("tiny-tp2-pp2", [[0, 1], [2, 3]], (2, 2)),
    ("tiny-pp2-tp2,1", [[0, 1], [2]], (2, 1)),
])
def test_a_tp_group_is_one_emulated_node(tmp_path: Path, profile: Profile, name: str, nodes: list,
                                         tp: tuple[int, ...]) -> None:
    """The fidelity's TP cases: each TP group's devices on one node of one type, so the inline
    layout (and check_tp) accepts them, and the plan uses every emulated device."""
    case = next(c for c in default_cases() if c.name == name)
    emulated, _ = emulate(case, profile, profile_name="p.json", directory=tmp_path, cores=2)
    assert [list(node.device_ids) for node in emulated.cluster.nodes] == nodes
    (layout,) = case_groups(case, emulated)
    assert layout.tp == tp and sorted(layout.devices) == list(range(case.world))
    assert "tensor parallel" in tags(layout, case) and f"tp{','.join(map(str, tp))}" in describe(layout)


def test_a_node_holds_one_slowdown(tmp_path: Path, profile: Profile) -> None:
    with pytest.raises(ValueError, match="share a node but not a slowdown"):
        emulated_cluster(profile, TINY, (1.0, 2.0), directory=tmp_path, profile_name="p.json",
                         node_sizes=(2,))
