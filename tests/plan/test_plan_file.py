"""The plan file: round trip, validation errors that name the field, atomic writes."""

from __future__ import annotations

import errno
import tomllib
from pathlib import Path

import pytest
import tomli_w

from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.lowering.predict import predict
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan, load_plan, save_plan
from medley.spec.cluster_load import load_cluster, parse_cluster_arg
from medley.spec.model_arg import get_model

EXAMPLES = Path(__file__).parents[2] / "examples"


def _plan(cluster_text: str = "2xA100-80GB+2xV100-32GB") -> Plan:
    if cluster_text.endswith(".toml"):
        cluster = load_cluster(EXAMPLES / cluster_text)
    else:
        cluster = parse_cluster_arg(cluster_text)
    model = get_model("tiny")
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=2, dp=2,
        schedule="zb-h1", micro_batches="5,3", micro_batch_size=2, seq_len=16, split="3,3", zero="3,1",
    )
    prediction, _, _ = predict(layout, cluster)
    return Plan(layout=layout, cluster=cluster, prediction=prediction)


@pytest.mark.parametrize("cluster_text", ["2xA100-80GB+2xV100-32GB", "demo.toml"])
def test_round_trip_keeps_layout_cluster_and_prediction(tmp_path: Path, cluster_text: str) -> None:
    plan = _plan(cluster_text)
    save_plan(plan, tmp_path / "plan.toml")
    loaded = load_plan(tmp_path / "plan.toml")
    assert loaded.layout == plan.layout
    assert loaded.prediction == plan.prediction
    assert [d.type.name for d in loaded.cluster.devices] == [d.type.name for d in plan.cluster.devices]
    assert loaded.prediction is not None and loaded.prediction.cost_source == "catalog"


def _edited(tmp_path: Path, edit) -> Path:
    save_plan(_plan(), tmp_path / "plan.toml")
    raw = tomllib.loads((tmp_path / "plan.toml").read_text())
    edit(raw)
    (tmp_path / "bad.toml").write_text(tomli_w.dumps(raw))
    return tmp_path / "bad.toml"


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda r: r.update(version=99), ["version", "plan versions 1 and 2"]),
        (lambda r: r["layout"].update(stage_layers=[3, 2]), ["layout.stage_layers", "6"]),
        (lambda r: r["layout"].update(assignment=[[0, 1]]), ["layout.assignment", "2 rows"]),
        (lambda r: r["layout"].update(assignment=[[0, 9], [1, 3]]), ["layout.assignment", "0..3"]),
        (lambda r: r["layout"].update(micro_batches=[4]), ["layout.micro_batches"]),
        (lambda r: r["layout"]["zero"][0].update(level=5), ["layout", "zero"]),
        (lambda r: r["layout"].update(schedule="nope"), ["layout", "nope"]),
        (lambda r: r["layout"].update(colour="red"), ["colour"]),
        (lambda r: r.update(model={"name": "gpt-9"}), ["model.name", "preset"]),
        (lambda r: r["cluster"]["nodes"][0].update(device="Z80"), ["cluster", "Z80"]),
    ],
)
def test_bad_plan_names_file_and_field(tmp_path: Path, edit, words: list[str]) -> None:
    path = _edited(tmp_path, edit)
    with pytest.raises(MedleyInputError) as err:
        load_plan(path)
    message = str(err.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_preset_name_alone_is_enough(tmp_path: Path) -> None:
    path = _edited(tmp_path, lambda r: r.update(model={"name": "tiny"}))
    assert load_plan(path).layout.model == get_model("tiny")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(MedleyInputError, match="cannot read the plan file"):
        load_plan(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("version = [")
    with pytest.raises(MedleyInputError, match="malformed TOML"):
        load_plan(tmp_path / "broken.toml")


def test_failed_save_leaves_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _plan()
    target = tmp_path / "plan.toml"
    save_plan(plan, target)
    before = target.read_text()

    def explode(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("medley.fileio.os.replace", explode)
    full = r"plan.toml: cannot write \(No space left on device, [0-9.]+ MiB free\)"
    with pytest.raises(MedleyInputError, match=full):
        save_plan(plan, target)
    assert target.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.toml"]


def test_documented_example_loads(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "docs" / "plan-format.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "plan.toml").write_text(example)
    plan = load_plan(tmp_path / "plan.toml")
    assert plan.layout.micro_batches == (5, 3) and plan.world_size == 4


def _set_layout(**fields):
    return lambda r: r["layout"].update(**fields)


@pytest.mark.parametrize(
    ("edit", "words"),
    [  # issue #11: a plan file with micro_batches = [1000000000, ...] ran until killed
        (_set_layout(micro_batches=[1000000000, 3]), ["layout.micro_batches[0]", "<= 10000"]),
        (_set_layout(micro_batches=[3, 10001]), ["layout.micro_batches[1]", "<= 10000"]),
        (lambda r: r["layout"]["zero"][0].update(gather_windows=10**9), ["gather_windows", "<= 256"]),
        (_set_layout(knobs={"virtual_stages": 10**9}), ["layout.knobs.virtual_stages", "out of range"]),
        # no coercion: pp = 3.0 and seq_len = "2048" were read as integers
        (_set_layout(pp=2.0), ["layout.pp", "valid integer", "whole number"]),
        (_set_layout(seq_len="16"), ["layout.seq_len", "valid integer"]),
        (_set_layout(clip_grad=1), ["layout.clip_grad", "valid boolean"]),
        # the hint said "greater than or equal to 1; fix: use a number >= 0"
        (_set_layout(micro_batch_size=0), ["greater than or equal to 1; fix: use a number >= 1."]),
        (lambda r: r["model"].update(hidden_size="64"), ["[model]", "hidden_size", "valid integer"]),
        (lambda r: r["model"].update(num_blocks=10**6), ["[model]", "num_blocks", "1..1,024"]),
        (lambda r: r["prediction"].update(step_time_s=float("inf")), ["prediction.step_time_s", "finite"]),
        (lambda r: r["prediction"].update(peak_memory_gb={"x": 1.0}), ["prediction.peak_memory_gb"]),
        (lambda r: r["cluster"]["nodes"][0].update(count=True), ["[cluster]", "count", "valid integer"]),
    ],
)
def test_plan_sizes_and_types_are_refused_in_one_line(tmp_path: Path, edit, words: list[str]) -> None:
    path = _edited(tmp_path, edit)
    with pytest.raises(MedleyInputError) as err:
        load_plan(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    for word in words:
        assert word in message


def test_plan_type_errors_point_to_the_plan_format(tmp_path: Path) -> None:
    path = _edited(tmp_path, lambda r: r["layout"].update(knobs={"virtual_stages": "two"}))
    with pytest.raises(MedleyInputError) as err:
        load_plan(path)
    assert "cluster-format" not in str(err.value)
    path = _edited(tmp_path, lambda r: r["layout"].update(assignment="all"))
    with pytest.raises(MedleyInputError, match="layout.assignment"):
        load_plan(path)
