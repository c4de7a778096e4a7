"""A plan stores the device types it was made for: made on a cluster whose catalog file is then
moved away (or changed), the plan still loads with the same devices, and ``medley show`` and
``medley train --plan`` read it; bad stored entries are one line naming the plan and field; plans
that name a catalog file (older medley) still load."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from medley.cli.main import app
from medley.errors import MedleyInputError
from medley.plan.plan import load_plan
from medley.spec.cluster_load import load_cluster

CATALOG = ('[devices."LAB-12GB"]\npeak_tflops_half = 20\npeak_tflops_fp32 = 5\nmemory_gb = 12\n'
           'memory_bandwidth_gbps = 400\nintra_node_link = "pcie"\nintra_node_bandwidth_gbps = 16\n'
           'supports_bf16 = true\nconfidence = "low"\n'
           '[devices."T4-16GB"]\npeak_tflops_half = 50.0\n')
CLUSTER = ('name = "lab"\ncatalog = "devices.toml"\n'
           '[[nodes]]\nname = "a"\ndevice = "LAB-12GB"\ncount = 2\n'
           '[[nodes]]\nname = "b"\ndevice = "T4-16GB"\ncount = 2\n'
           '[[tiers]]\nname = "ethernet"\nbandwidth_gbit = 25\n')
runner = CliRunner()


@pytest.fixture
def plan_path(tmp_path: Path) -> Path:
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "devices.toml").write_text(CATALOG)
    (lab / "cluster.toml").write_text(CLUSTER)
    out = tmp_path / "plan.toml"
    result = runner.invoke(app, ["plan", "--cluster", str(lab / "cluster.toml"), "--model", "tiny",
                                 "--global-batch", "8", "--seq-len", "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _types(cluster) -> list[tuple]:
    return [dataclasses.astuple(d.type) for d in cluster.devices]


def test_the_plan_keeps_its_device_types_when_the_catalog_goes(plan_path: Path, tmp_path: Path) -> None:
    want = _types(load_cluster(tmp_path / "lab" / "cluster.toml"))
    raw = tomllib.loads(plan_path.read_text())
    assert "catalog" not in raw["cluster"] and set(raw["cluster"]["device_types"]) == {"LAB-12GB", "T4-16GB"}
    (tmp_path / "lab" / "devices.toml").unlink()
    moved = tmp_path / "elsewhere" / "plan.toml"
    moved.parent.mkdir()
    plan_path.rename(moved)
    assert _types(load_plan(moved).cluster) == want  # the override of T4 included
    assert load_plan(moved).cluster.devices[2].type.peak_tflops_half == 50.0
    shown = runner.invoke(app, ["show", str(moved)])
    assert shown.exit_code == 0, shown.output
    assert "re-simulated now" in shown.output


def test_a_bad_stored_device_type_is_one_line(plan_path: Path) -> None:
    raw = tomllib.loads(plan_path.read_text())
    raw["cluster"]["device_types"]["LAB-12GB"]["memory_gb"] = -1
    plan_path.write_text(tomli_w.dumps(raw))
    with pytest.raises(MedleyInputError, match=r"plan\.toml \[cluster\].*device_types\.LAB-12GB\.memory_gb"):
        load_plan(plan_path)


def test_a_plan_naming_a_catalog_file_still_loads(plan_path: Path, tmp_path: Path) -> None:
    raw = tomllib.loads(plan_path.read_text())
    del raw["cluster"]["device_types"]
    raw["cluster"]["catalog"] = str(tmp_path / "lab" / "devices.toml")
    plan_path.write_text(tomli_w.dumps(raw))
    assert _types(load_plan(plan_path).cluster) == _types(load_cluster(tmp_path / "lab" / "cluster.toml"))
