"""Metis-format files of tensor-parallel degree 2 and 4 (real OPT-350 measurements) answer one TP
rank's block time: the file's time less its all-reduces, which the compiler then times on the
plan's own group; the roofline's ratio is used only where no such file is."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from medley.cost.comm import TopologyCommModel
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Collective, Pass
from medley.cost.metis import MetisCostSource
from medley.cost.tp_cost import TensorParallelCompute, tp_comm_time
from medley.cost.user_profiles import measured_cost_source
from medley.errors import MedleyInputError
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

PROFILES = Path(__file__).parents[1] / "data" / "metis-opt-350"
OPT = get_model("opt-350m")
SEQ = 2048
BLOCK = 3


@pytest.fixture(scope="module")
def source() -> MetisCostSource:
    return MetisCostSource.from_directory(PROFILES, OPT)


def _file_ms(gpu: str, mbs: int, tp: int) -> list[float]:
    raw = json.loads((PROFILES / gpu / f"mbs{mbs}_tmp{tp}.json").read_text())
    return raw["execution_time"]["layer_compute_total_ms"]


@pytest.mark.parametrize(("gpu", "device", "mbs", "tp"), [
    ("A100-40", "A100-40GB", 1, 2), ("A100-40", "A100-40GB", 4, 4), ("V100-16", "V100-16GB", 2, 2),
])
def test_a_block_is_the_files_time_less_its_all_reduces(source, gpu, device, mbs, tp) -> None:
    at = {"micro_batch_size": mbs, "seq_len": SEQ, "device_type": device, "tp": tp}
    passes = [source.tp_layer_time(BLOCK, p, **at) for p in Pass]
    node = parse_cluster_arg(f"{tp}x{device}")
    fp32_boundary = mbs * SEQ * OPT.hidden_size * 4
    all_reduces = 4 * TopologyCommModel(node).collective_time(Collective.ALL_REDUCE, tuple(range(tp)),
                                                              fp32_boundary)
    assert sum(t.seconds for t in passes) + all_reduces == pytest.approx(_file_ms(gpu, mbs, tp)[BLOCK] / 1e3)
    assert passes[0].source == f"metis:{gpu}/mbs{mbs}_tmp{tp}.json"
    assert 0 < all_reduces < 0.1 * _file_ms(gpu, mbs, tp)[BLOCK] / 1e3


def test_only_measured_blocks_answer(source) -> None:
    at = {"seq_len": SEQ, "device_type": "A100-40GB", "tp": 2}
    assert source.tp_layer_time(0, Pass.F, micro_batch_size=1, **at) is None  # embedding: replicated
    assert source.tp_layer_time(OPT.num_layers - 1, Pass.F, micro_batch_size=1, **at) is None  # head
    assert source.tp_layer_time(BLOCK, Pass.F, micro_batch_size=3, **at) is None  # no such file
    assert source.tp_layer_time(BLOCK, Pass.F, micro_batch_size=1, seq_len=SEQ, device_type="A100-40GB",
                                tp=8) is None


def test_the_measurement_replaces_the_rooflines_ratio(source) -> None:
    """At mbs 1 and tp 4 the fp32 roofline promised a rank 27% of the whole block (bf16: 32%); the
    A100 measured 51%."""
    catalog = CatalogCostSource(OPT, dtype="fp32")
    at = {"micro_batch_size": 1, "seq_len": SEQ, "device_type": "A100-40GB"}
    measured = TensorParallelCompute(OPT, source, catalog=catalog)
    roofline = TensorParallelCompute(OPT, CatalogCostSource(OPT, dtype="fp32"), catalog=catalog)
    got = sum(measured.layer_time(BLOCK, p, tp=4, **at) for p in Pass)
    whole = sum(source.layer_time(BLOCK, p, **at).seconds for p in Pass)
    assert got == pytest.approx(sum(source.tp_layer_time(BLOCK, p, tp=4, **at).seconds for p in Pass))
    assert got / whole > 0.45
    assert sum(roofline.layer_time(BLOCK, p, tp=4, **at) for p in Pass) / sum(
        catalog.layer_time(BLOCK, p, **at).seconds for p in Pass) < 0.3
    assert measured.scale(Pass.F, tp=4, **at) == pytest.approx(
        source.tp_layer_time(1, Pass.F, tp=4, **at).seconds / source.layer_time(1, Pass.F, **at).seconds)


def test_a_planned_tp_stage_is_timed_from_the_files() -> None:
    cluster = parse_cluster_arg("4xA100-40GB+2xV100-16GB")
    catalog = CatalogCostSource.for_cluster(OPT, cluster)
    cost = measured_cost_source(catalog, cluster, profiles_dir=PROFILES)
    layout = inline_layout(cluster=cluster, model=OPT, cost=cost, pp=2, dp=1, schedule="1f1b",
                           micro_batches="4", micro_batch_size=1, seq_len=SEQ, split="13,13", zero="0,0")
    layout = dataclasses.replace(layout, assignment=((0, 2),), tp=(2, 1))
    problem = compile_problem(layout, cluster, cost)
    comm = TopologyCommModel(cluster)
    at = {"micro_batch_size": 1, "seq_len": SEQ, "device_type": "A100-40GB"}
    want = sum((cost.tp_layer_time(i, Pass.F, tp=2, **at) or cost.layer_time(i, Pass.F, **at)).seconds
               + tp_comm_time(comm, OPT, i, Pass.F, group=(0, 1), micro_batch_size=1, seq_len=SEQ,
                              dtype=layout.dtype)
               for i in layout.layer_range(0))
    assert problem.stage_costs[0][0].forward_s == pytest.approx(want, rel=1e-9, abs=1e-5)


def test_a_tp_file_of_another_model_names_itself(tmp_path) -> None:
    shutil.copytree(PROFILES, tmp_path / "p")
    bad = tmp_path / "p" / "A100-40" / "mbs1_tmp2.json"
    raw = json.loads(bad.read_text())
    raw["execution_time"]["layer_compute_total_ms"] = [1.0, 2.0, 3.0]
    bad.write_text(json.dumps(raw))
    with pytest.raises(MedleyInputError, match=r"mbs1_tmp2.json: 3 profiled layers but opt-350m has 26"):
        MetisCostSource.from_directory(tmp_path / "p", OPT)


def test_a_profiles_directory_with_types_the_cluster_lacks_is_used_for_the_others() -> None:
    """A directory holds profiles of more types than the cluster has (the public set: seven): the
    cluster's types are read, the others named in one note; one with none of them is refused."""
    cluster = parse_cluster_arg("4xA100-40GB")
    catalog = CatalogCostSource.for_cluster(OPT, cluster)
    notes: list[str] = []
    cost = measured_cost_source(catalog, cluster, profiles_dir=PROFILES, notes=notes)
    at = {"micro_batch_size": 1, "seq_len": SEQ, "device_type": "A100-40GB"}
    assert cost.layer_time(1, Pass.F, **at).source.startswith("metis")
    said = f"--profiles {PROFILES}: left out the profiles of V100-16, types the cluster does not have"
    assert notes == [said]
    with pytest.raises(MedleyInputError, match="no profile of a type cluster '4xH100-80GB' has"):
        measured_cost_source(catalog, parse_cluster_arg("4xH100-80GB"), profiles_dir=PROFILES)


def test_the_reported_sources_name_the_tp_files_read(tmp_path: Path) -> None:
    """`plan/show/simulate --json`'s cost_sources: a TP 2 stage's blocks name the _tmp2 file the
    compiler reads, not the tp1 one; where no such file is, the scaled tp1 time says so."""
    from medley.lowering.predict import cost_source_name, layer_sources

    cluster = parse_cluster_arg("4xA100-40GB+2xV100-16GB")
    catalog = CatalogCostSource.for_cluster(OPT, cluster)
    cost = measured_cost_source(catalog, cluster, profiles_dir=PROFILES)
    layout = inline_layout(cluster=cluster, model=OPT, cost=cost, pp=2, dp=1, schedule="1f1b",
                           micro_batches="4", micro_batch_size=1, seq_len=SEQ, split="13,13", zero="0,0")
    layout = dataclasses.replace(layout, assignment=((0, 4),), tp=(2, 1))
    sources = layer_sources(layout, cluster, cost)
    assert sources["A100-40GB tp2"]["block"] == "metis:A100-40/mbs1_tmp2.json"
    assert sources["A100-40GB"]["block"] == "metis:A100-40/mbs1_tmp1.json"
    assert sources["A100-40GB tp2"]["embedding"].endswith(" scaled to tp2")  # embeddings are not measured
    assert set(sources) == {"A100-40GB", "A100-40GB tp2", "V100-16GB"}
    assert "scaled" not in cost_source_name(layout, cost, cluster)
    # Without the tp2 files, the block time is the tp1 file's, scaled.
    copy = tmp_path / "profiles"
    shutil.copytree(PROFILES, copy)
    for path in copy.rglob("*_tmp2.json"):
        path.unlink()
    cost = measured_cost_source(catalog, cluster, profiles_dir=copy)
    assert layer_sources(layout, cluster, cost)["A100-40GB tp2"]["block"] == \
        "metis:A100-40/mbs1_tmp1.json scaled to tp2"
