"""The profile file: round trip, version check, and errors that name the file, field and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medley.cost.profile_format import Profile, load_profile, save_profile
from medley.errors import MedleyInputError


def test_round_trip(tmp_path: Path, profile: Profile) -> None:
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["version"] == 1


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


def test_unknown_version_is_refused(tmp_path: Path, profile: Profile) -> None:
    data = profile.model_dump(mode="json") | {"version": 99}
    with pytest.raises(MedleyInputError, match=r"'version' is 99.*reads version 1.*medley profile"):
        load_profile(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d | {"format": "metis"}, r"field 'format' must be 'medley-profile'"),
        (lambda d: {k: v for k, v in d.items() if k != "layers"}, r"field 'layers'.*fix: add this field"),
        (lambda d: d | {"layers": [d["layers"][0] | {"forward_s": -1.0}]}, r"layers\[0\]\.forward_s"),
        (lambda d: d | {"layers": [d["layers"][0] | {"kind": "mlp"}]}, r"layers\[0\]\.kind"),
        (lambda d: d | {"dtype": "int8"}, r"field 'dtype'"),
        (lambda d: d | {"model": {"name": "x"}}, r"p\.json \[model\]: field 'vocab_size'.*add this field"),
    ],
    ids=["format", "missing-layers", "negative-time", "bad-kind", "dtype", "model"],
)
def test_bad_contents_name_the_field(tmp_path: Path, profile: Profile, mutate, message: str) -> None:
    with pytest.raises(MedleyInputError, match=message):
        load_profile(_write(tmp_path, mutate(profile.model_dump(mode="json"))))


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(MedleyInputError, match="cannot read the profile file.*check --profile"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MedleyInputError, match="not a JSON profile file"):
        load_profile(bad)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [  # issue #11: no coercion, finite numbers, one line, and the hint names the profile's format
        (lambda d: d | {"threads": "4"}, ["field 'threads'", "valid integer"]),
        (lambda d: d | {"threads": True}, ["field 'threads'", "valid integer"]),
        (lambda d: d | {"layers": [d["layers"][0] | {"seq_len": 64.0}]}, ["layers[0].seq_len", "integer"]),
        (lambda d: d | {"layers": [d["layers"][0] | {"forward_s": 1e999}]}, ["forward_s", "finite"]),
        (lambda d: d | {"model": d["model"] | {"hidden_size": "64"}}, ["[model]", "hidden_size"]),
        (lambda d: d | {"comm": d["comm"] | {"link_by_ranks": {"two": d["comm"]["link"]}}},
         ["comm.link_by_ranks"]),
        (lambda d: d | {"layers": [d["layers"][0] | {"kind": 1, "runs": 0}]}, ["(1 more problems)"]),
    ],
)
def test_bad_types_are_one_line_without_coercion(tmp_path: Path, profile: Profile, mutate, words) -> None:
    with pytest.raises(MedleyInputError) as info:
        load_profile(_write(tmp_path, mutate(profile.model_dump(mode="json"))))
    message = str(info.value)
    assert "\n" not in message and "cluster-format" not in message
    for word in words:
        assert word in message


def test_optimizer_measurements_read_back_from_json(tmp_path: Path, profile: Profile) -> None:
    data = profile.model_dump(mode="json")
    data["optimizer"]["measurements"] = [[1000, 0.5], [2000, 1]]
    assert load_profile(_write(tmp_path, data)).optimizer.measurements == [(1000, 0.5), (2000, 1.0)]


@pytest.mark.parametrize("keys", [
    ("forward_s", "backward_input_s", "backward_weight_s", "backward_full_s"),
    ("forward_s",), ("backward_full_s",), ("backward_input_s", "backward_weight_s"),
])
def test_zero_times_are_refused(tmp_path: Path, profile: Profile, keys: tuple[str, ...]) -> None:
    """Issue 26, finding 11: a profile with every time 0 passed and the planner divided by zero."""
    data = profile.model_dump(mode="json")
    data["layers"] = [layer | dict.fromkeys(keys, 0.0) for layer in data["layers"]]
    with pytest.raises(MedleyInputError) as info:
        load_profile(_write(tmp_path, data))
    message = str(info.value)
    assert "\n" not in message and "field 'layers[0]" in message, message
    assert "greater than 0" in message or "backward_input_s + backward_weight_s must be > 0" in message
