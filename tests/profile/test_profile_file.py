"""The profile file: round trip, version check, and errors that name the file, field and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medley.cost.profiles import Profile, load_profile, save_profile
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
    with pytest.raises(MedleyInputError, match=r"'version' is 99.*reads profile version 1.*medley profile"):
        load_profile(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d | {"format": "metis"}, r"field 'format' must be 'medley-profile'"),
        (lambda d: {k: v for k, v in d.items() if k != "layers"}, r"field 'layers'.*fix: add this field"),
        (lambda d: d | {"layers": [d["layers"][0] | {"forward_s": -1.0}]}, r"layers\[0\]\.forward_s"),
        (lambda d: d | {"layers": [d["layers"][0] | {"kind": "mlp"}]}, r"layers\[0\]\.kind"),
        (lambda d: d | {"dtype": "int8"}, r"field 'dtype'"),
        (lambda d: d | {"model": {"name": "x"}}, r"profile table 'model'"),
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
