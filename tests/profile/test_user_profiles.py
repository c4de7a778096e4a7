"""Issue #12, item 4: the user's own profiles reach plan, show and simulate (one per device type,
both Metis layouts), are matched to the cluster's types or refused, and `medley profile` names
its device type from the catalog."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Pass
from medley.cost.metis import MetisCostSource
from medley.cost.profile_format import Profile, save_profile
from medley.cost.user_profiles import measured_cost_source
from medley.errors import MedleyInputError
from medley.profile.run import profile_device_type
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

DATA = Path(__file__).parents[1] / "data"
METIS_OWN = DATA / "metis-own-opt-350"
REPACKAGED = DATA / "metis-opt-350"
MIXED = "2xA100-80GB+2xV100-32GB"
TINY = get_model("tiny")


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


TIMES = ("forward_s", "backward_input_s", "backward_weight_s", "backward_full_s")


@pytest.fixture
def labelled(tmp_path: Path, profile: Profile):
    """``labelled(device_type, scale=, name=)``: the hand-made tiny profile (conftest), labelled as
    ``device_type``, its times x ``scale``, saved under ``tmp_path``."""

    def make(device_type: str, *, scale: float = 1.0, name: str | None = None) -> Path:
        layers = [m.model_copy(update={f: getattr(m, f) * scale for f in TIMES}) for m in profile.layers]
        path = tmp_path / (name or f"{device_type}.json")
        save_profile(profile.model_copy(update={"device_type": device_type, "layers": layers}), path)
        return path

    return make


def _plan(*extra: str) -> dict:
    code, out = _run("plan", "--cluster", MIXED, "--model", "tiny", "--global-batch", "8", "--seq-len", "64",
                     "--top", "5", "--json", *extra)
    assert code == 0, out
    return json.loads(out)


def test_a_profile_of_a_named_type_changes_plans_layer_times_for_that_type(labelled) -> None:
    # Measured on this CPU, labelled V100-32GB (`medley profile --device-type V100-32GB`), and
    # made fast enough that the planner puts V100s in its plans.
    path = labelled("V100-32GB", scale=1e-3, name="v100.json")
    catalog, measured = _plan(), _plan("--profile", str(path))
    with_v100 = [row for row in measured["plans"] if "V100-32GB" in row["cost_sources"]]
    assert with_v100, measured["plans"]
    for row in measured["plans"]:
        sources = row["cost_sources"]
        assert all(s.startswith("profile:v100.json") for s in sources.get("V100-32GB", {}).values())
        assert set(sources.get("A100-80GB", {}).values()) <= {"catalog"}
    assert "profile:v100.json" in with_v100[0]["cost_source"]
    assert all("profile" not in row["cost_source"] for row in catalog["plans"])
    assert [r["step_time_s"] for r in catalog["plans"]] != [r["step_time_s"] for r in measured["plans"]]


def test_profiles_of_two_types_each_answer_for_their_own(labelled) -> None:
    v100 = labelled("V100-32GB", scale=2.0)
    a100 = labelled("A100-80GB", scale=0.5)
    code, out = _run("simulate", "--cluster", "1xA100-80GB+1xV100-32GB", "--model", "tiny", "--pp", "2",
                     "--seq-len", "64", "--micro-batches", "4", "--profile", str(a100),
                     "--profile", str(v100), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["dtype"] == "fp32"  # the profiles'
    assert set(data["cost_sources"]["A100-80GB"].values()) == {"profile:A100-80GB.json"}
    assert set(data["cost_sources"]["V100-32GB"].values()) == {"profile:V100-32GB.json"}
    cluster = parse_cluster_arg("1xA100-80GB+1xV100-32GB+1xT4-16GB")
    cost = measured_cost_source(CatalogCostSource.for_cluster(TINY, cluster), cluster, profiles=[a100, v100])
    shape = {"micro_batch_size": 1, "seq_len": 64}
    types = ("A100-80GB", "V100-32GB", "T4-16GB")
    fused = {t: cost.backward_full_time(1, device_type=t, **shape) for t in types}
    assert fused["V100-32GB"].seconds == pytest.approx(4 * fused["A100-80GB"].seconds)
    assert fused["T4-16GB"] is None  # the catalog's: the compiler uses its formulas
    assert cost.activation_bytes(1, device_type="T4-16GB", **shape) is None
    assert cost.activation_bytes(1, device_type="V100-32GB", **shape) == (64000.0, 25600.0)


def test_a_profile_labelled_with_the_cuda_name_is_used(labelled) -> None:
    """Before: `medley profile --device cuda` wrote "NVIDIA A100-SXM4-80GB", which matched no
    catalog name, and the profile was silently unused ("layer times from ... catalog")."""
    path = labelled("NVIDIA A100-SXM4-80GB", name="a100.json")
    code, out = _run("simulate", "--cluster", "2xA100-80GB", "--model", "tiny", "--pp", "2", "--seq-len",
                     "64", "--micro-batches", "4", "--profile", str(path), "--json")
    assert code == 0, out
    assert set(json.loads(out)["cost_sources"]["A100-80GB"].values()) == {"profile:a100.json"}


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_profile_of_no_type_of_the_cluster_is_refused(labelled, command: str) -> None:
    path = labelled("CPU-8GB", name="cpu.json")
    extra = ["--global-batch", "8"] if command == "plan" else []
    code, out = _run(command, "--cluster", MIXED, "--model", "tiny", "--seq-len", "64", *extra,
                     "--profile", str(path))
    assert code == 2, out
    line = out.strip()
    assert "\n" not in line and "cpu.json" in line and "'CPU-8GB'" in line
    assert "its types: A100-80GB, V100-32GB" in line


def test_show_takes_the_profiles_and_refuses_an_unmatched_one(tmp_path: Path, labelled) -> None:
    plan_file = tmp_path / "plan.toml"
    code, out = _run("plan", "--cluster", MIXED, "--model", "tiny", "--global-batch", "8", "--seq-len", "64",
                     "--micro-batch-sizes", "1,4", "--out", str(plan_file), "--json")
    assert code == 0, out
    used = {t for t in json.loads(out)["plans"][0]["cost_sources"]}
    label = sorted(used)[0]
    path = labelled(label, name="mine.json")
    code, out = _run("show", str(plan_file), "--profile", str(path), "--json")
    assert code == 0, out
    assert set(json.loads(out)["cost_sources"][label].values()) == {"profile:mine.json"}
    code, out = _run("show", str(plan_file), "--profile", str(labelled("T4-16GB")))
    assert code == 2 and "'T4-16GB'" in out and "\n" not in out.strip()


def test_two_profiles_of_one_type_or_of_another_model_are_refused(labelled) -> None:
    first = labelled("V100-32GB", name="a.json")
    second = labelled("V100", name="b.json")  # an alias of V100-16GB, not V100-32GB
    third = labelled("V100-32GB", name="c.json")
    base = ["simulate", "--cluster", MIXED, "--model", "tiny", "--seq-len", "64"]
    code, out = _run(*base, "--profile", str(first), "--profile", str(third))
    assert code == 2 and "c.json: a second profile of device type 'V100-32GB' (--profile" in out
    code, out = _run(*base, "--profile", str(second))
    assert code == 2 and "'V100'" in out
    code, out = _run("simulate", "--cluster", MIXED, "--model", "llama-2-7b", "--profile", str(first))
    assert code == 2 and "measured model 'tiny', not 'llama-2-7b'" in out and "\n" not in out.strip()


def test_metis_own_layout_is_read() -> None:
    opt = get_model("opt-350m")
    own = MetisCostSource.from_directory(METIS_OWN, opt)
    repackaged = MetisCostSource.from_directory(REPACKAGED, opt)
    assert own.profile.seq_len == 2048  # from the V100 files; the A100 ones do not record it
    assert own.profile.micro_batch_sizes("A100-40GB") == (1, 2)  # the tp2 file answers TP questions
    tp2 = {"micro_batch_size": 1, "seq_len": 2048, "device_type": "A100-40GB", "tp": 2}
    assert own.tp_layer_time(3, Pass.F, **tp2).seconds == repackaged.tp_layer_time(3, Pass.F, **tp2).seconds
    assert own.profile.micro_batch_sizes("V100-16GB") == (1, 2)
    for device in ("A100-40GB", "V100-16GB"):
        for layer in (0, 5, opt.num_layers - 1):
            shape = {"micro_batch_size": 2, "seq_len": 2048, "device_type": device}
            got = [own.layer_time(layer, p, **shape) for p in Pass]
            want = [repackaged.layer_time(layer, p, **shape).seconds for p in Pass]
            assert [t.seconds for t in got] == pytest.approx(want)
    a100 = own.layer_time(3, Pass.F, micro_batch_size=1, seq_len=2048, device_type="A100-40GB")
    assert a100.source == "metis:DeviceType.A100_tp1_bs1.json"


def test_plan_reads_metis_own_layout_and_matches_bare_gpu_names_to_the_cluster() -> None:
    code, out = _run("plan", "--cluster", "4xA100-80GB+4xV100-16GB", "--model", "opt-350m", "--global-batch",
                     "32", "--profiles", str(METIS_OWN), "--micro-batch-sizes", "1,2", "--top", "2", "--json")
    assert code == 0, out
    sources = json.loads(out)["plans"][0]["cost_sources"]
    for device, gpu in (("A100-80GB", "A100"), ("V100-16GB", "V100")):  # "A100" -> the cluster's A100-80GB
        if device in sources:
            assert all(s.startswith(f"metis:DeviceType.{gpu}_tp1_bs") for s in sources[device].values())
    assert sources


def test_metis_profiles_must_match_the_cluster() -> None:
    """A directory may hold types the cluster lacks (named in a note); it must hold one it has,
    and a GPU name must not stand for two of its types."""
    opt = ["--model", "opt-350m", "--global-batch", "32"]
    code, out = _run("plan", "--cluster", "4xA100-40GB", *opt, "--profiles", str(REPACKAGED), "--top", "1")
    assert code == 0 and "left out the profiles of V100-16, types the cluster does not have" in out
    code, out = _run("plan", "--cluster", "4xH100-80GB", *opt, "--profiles", str(REPACKAGED))
    assert code == 2 and "no profile of a type cluster '4xH100-80GB' has" in out
    assert "its types: H100-SXM-80GB; the directory's: A100-40, V100-16" in out
    code, out = _run("plan", "--cluster", "2xA100-80GB+2xA100-PCIE-80GB+2xV100-16GB", *opt,
                     "--profiles", str(METIS_OWN))
    assert code == 2 and "GPU name 'A100' could be any of A100-80GB, A100-PCIE-80GB" in out


def test_metis_files_without_the_sequence_length_take_the_plans(tmp_path: Path) -> None:
    for path in METIS_OWN.glob("DeviceType.A100_tp1_*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    opt = get_model("opt-350m")
    with pytest.raises(MedleyInputError, match="do not record the sequence length"):
        MetisCostSource.from_directory(tmp_path, opt)
    assert MetisCostSource.from_directory(tmp_path, opt, assumed_seq_len=1024).profile.seq_len == 1024


def test_profile_names_its_device_type_from_the_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    assert profile_device_type("cpu", None) == "CPU-8GB"
    assert profile_device_type("cpu", "v100-sxm2-32gb") == "V100-32GB"
    with pytest.raises(MedleyInputError, match=r"^--device-type V100-33GB: unknown device type .*V100-32GB"):
        profile_device_type("cpu", "V100-33GB")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    assert profile_device_type("cuda", None) == "A100-80GB"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-96GB")
    with pytest.raises(MedleyInputError, match="--device-type"):
        profile_device_type("cuda", None)


def test_profile_cli_labels_the_file_with_device_type(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ["profile", "--model", "tiny", "--micro-batch-sizes", "1", "--seq-len", "16", "--runs", "1",
            "--no-overhead", "--comm-ranks", "0", "--json", "--out", str(out)]
    code, text = _run(*args, "--device-type", "V100-32GB")
    assert code == 0, text
    assert Profile.model_validate_json(out.read_text()).device_type == "V100-32GB"
    code, text = _run(*args, "--device-type", "V100-33GB")
    assert code == 2 and "--device-type V100-33GB" in text and "\n" not in text.strip()
