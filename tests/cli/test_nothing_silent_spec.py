"""Issue 46, plan and cluster files: bf16 is checked against every device of a plan wherever a plan
is made, loaded or simulated (the reason shown is then true); a ``device_types`` entry that no node
uses is refused (a renamed entry left its node on the catalog's type without a word); a model
``name`` that is a preset must have the preset's fields; types are strict in plan and cluster files
as in job files. Each refusal is one line (exit 2) naming the file or flag, the field and the fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from refusals import one_line_refusal, runner

from medley.cli.main import app
from medley.cli.preflight import preflight
from medley.errors import MedleyInputError
from medley.fileio import read_toml
from medley.plan.plan import load_plan
from medley.spec.cluster_load import load_cluster

MIXED = "1xA100-80GB+1xV100-32GB"


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "base.toml"
    made = runner.invoke(app, ["plan", "--cluster", MIXED, "--model", "tiny", "--global-batch", "8",
                               "--seq-len", "64", "--out", str(out)])
    assert made.exit_code == 0, made.output
    return out


def edited(base: Path, tmp_path: Path, edit, name: str = "edited.toml") -> Path:  # noqa: ANN001
    raw = read_toml(base, what="plan")
    edit(raw)
    out = tmp_path / name
    out.write_text(tomli_w.dumps(raw))
    return out


# Finding 3: on 415c156 simulate exited 0 saying "bf16: every device of the plan has it" and timed
# the V100 at its fp16 peak; show of such a plan file said the same.
def test_simulate_refuses_bf16_on_a_device_without_it() -> None:
    line = one_line_refusal(["simulate", "--cluster", MIXED, "--model", "tiny", "--pp", "2",
                             "--dtype", "bf16", "--seq-len", "64"])
    assert line.startswith("error: --dtype bf16: V100-32GB has no bf16;") and "--dtype fp16" in line


def test_the_precision_shown_is_the_one_the_devices_allow() -> None:
    mixed = runner.invoke(app, ["simulate", "--cluster", MIXED, "--model", "tiny", "--pp", "2",
                                "--seq-len", "64", "--json"])
    assert mixed.exit_code == 0, mixed.output
    data = json.loads(mixed.output)
    assert (data["dtype"], data["precision"]) == ("fp16", "fp16 with loss scaling: V100-32GB has no bf16")
    alike = runner.invoke(app, ["simulate", "--cluster", "2xA100-80GB", "--model", "tiny", "--pp", "2",
                                "--dtype", "bf16", "--seq-len", "64", "--json"])
    assert alike.exit_code == 0, alike.output
    assert json.loads(alike.output)["precision"] == "bf16: every device of the plan has it"


def test_a_bf16_plan_file_on_a_v100_is_refused_by_every_command(base_plan: Path, tmp_path: Path) -> None:
    def to_bf16(raw: dict) -> None:
        raw["layout"]["dtype"] = "bf16"

    plan = edited(base_plan, tmp_path, to_bf16)
    want = f"error: {plan}: field 'layout.dtype' = \"bf16\": V100-32GB has no bf16; set dtype = \"fp16\""
    for args in (["show", str(plan)], ["check", str(plan)], ["doctor", "--plan", str(plan)],
                 ["train", "--plan", str(plan), "--local-ranks", "2", "--steps", "1"]):
        assert one_line_refusal(args).startswith(want), args


def test_plan_dtype_bf16_is_refused_by_the_search_as_before() -> None:
    line = one_line_refusal(["plan", "--cluster", MIXED, "--model", "tiny", "--global-batch", "8",
                             "--seq-len", "64", "--dtype", "bf16"])
    assert line == ("error: --dtype bf16: V100-32GB has no bf16; give --dtype fp16 or fp32, or leave "
                    "those devices out with --exclude-devices.")


def test_a_cuda_run_refuses_dtype_bf16_where_a_gpu_lacks_it(base_plan: Path) -> None:
    plan = load_plan(base_plan)
    with pytest.raises(MedleyInputError, match=r"^--dtype bf16: V100-32GB has no bf16; give --dtype fp16"):
        preflight(plan, dtype="bf16", local_ranks=2, on_cuda=True)
    preflight(plan, dtype="fp16", local_ranks=2, on_cuda=True)  # the plan's own precision runs
    preflight(plan, dtype="bf16", local_ranks=2, on_cuda=False)  # a CPU run emulates the devices


# Finding 6: on 415c156 a renamed entry was dropped and the V100 node took the catalog's V100.
def test_a_renamed_device_type_in_a_plan_is_refused(base_plan: Path, tmp_path: Path) -> None:
    def rename(raw: dict) -> None:
        types = raw["cluster"]["device_types"]
        types["V100-32G"] = types.pop("V100-32GB")

    plan = edited(base_plan, tmp_path, rename)
    assert one_line_refusal(["show", str(plan)]) == (
        f"error: {plan} [cluster]: field 'device_types.V100-32G': no node uses this device type (the "
        "nodes use A100-80GB, V100-32GB); name it in a node's `device`, or remove the entry")


def cluster_file(tmp_path: Path, device_types: dict, device: str = "V100-32GB") -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(tomli_w.dumps({"name": "lab", "device_types": device_types,
                                   "nodes": [{"name": "n0", "device": device, "count": 2}]}))
    return path


def test_an_unused_device_type_in_a_cluster_file_is_refused(tmp_path: Path) -> None:
    path = cluster_file(tmp_path, {"V100-32GB": {"memory_gb": 30.0}, "A100-80GB": {"memory_gb": 70.0}})
    with pytest.raises(MedleyInputError, match=r"field 'device_types.A100-80GB': no node uses this device "
                                               r"type \(the nodes use V100-32GB\)"):
        load_cluster(path)


@pytest.mark.parametrize(("entry", "device"), [("V100-32GB", "V100-32GB"), ("v100-32gb", "V100-32GB"),
                                               ("V100-32GB", "v100-32gb")])
def test_a_used_entry_is_used_whatever_its_spelling(tmp_path: Path, entry: str, device: str) -> None:
    cluster = load_cluster(cluster_file(tmp_path, {entry: {"memory_gb": 30.0}}, device=device))
    assert [d.type.memory_gb for d in cluster.devices] == [30.0, 30.0]


# Finding 7: on 415c156 tiny's fields under name = "llama-2-7b" were shown and titled llama-2-7b.
def test_a_preset_name_over_other_fields_is_refused(base_plan: Path, tmp_path: Path) -> None:
    def retitle(raw: dict) -> None:
        raw["model"]["name"] = "llama-2-7b"

    line = one_line_refusal(["show", str(edited(base_plan, tmp_path, retitle))])
    assert "field 'name' = 'llama-2-7b' is a preset, but vocab_size = 256 (the preset's: 32000)" in line
    assert line.endswith("give the model a name of its own, or leave out the fields that differ to use "
                         "the preset")


def test_a_model_of_its_own_name_is_shown_by_that_name(base_plan: Path, tmp_path: Path) -> None:
    def rename(raw: dict) -> None:
        raw["model"]["name"] = "lab-tiny"

    shown = runner.invoke(app, ["show", str(edited(base_plan, tmp_path, rename))])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"^\s*lab-tiny · ", shown.output, flags=re.M), shown.output


# Types: strict in plan and cluster files as in job files (no bool for a number, no float for
# an integer, no text for a number, no array for a scalar).
WRONG = st.sampled_from([True, False, 2.5, 4.0, "4", [4]])
PLAN_INTEGERS = [("layout", "seq_len"), ("layout", "micro_batch_size"), ("layout", "pp"), ("layout", "dp")]


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(PLAN_INTEGERS), value=WRONG)
def test_plan_file_integers_take_integers_only(base_plan: Path, tmp_path: Path, field: tuple[str, str],
                                               value: object) -> None:
    table, key = field

    def put(raw: dict) -> None:
        raw[table][key] = value

    with pytest.raises(MedleyInputError, match=rf"field '{table}\.{key}'"):
        load_plan(edited(base_plan, tmp_path, put))


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["count", "repeat", "memory_gb"]), value=WRONG)
def test_cluster_file_numbers_take_numbers_only(tmp_path: Path, key: str, value: object) -> None:
    if key == "memory_gb" and type(value) is float:
        return  # a float is the right type for a size in GB
    path = tmp_path / "cluster.toml"
    path.write_text(tomli_w.dumps({"name": "lab", "nodes": [{"name": "n0", "device": "V100-32GB",
                                                             "count": 2, key: value}]}))
    with pytest.raises(MedleyInputError, match=rf"field 'nodes\[0\]\.{key}'|field 'nodes.0.{key}'"):
        load_cluster(path)
