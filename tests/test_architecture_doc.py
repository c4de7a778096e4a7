"""docs/architecture.md is the map of the package: every subpackage of medley has its row, and
every module, folder and named object it points at exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "medley"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_subpackage_has_a_row() -> None:
    packages = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    rows = re.findall(r"^\| `medley/(\w+)` \|", DOC, flags=re.MULTILINE)
    assert sorted(rows) == packages
    assert len(set(rows)) == len(rows)


def test_every_path_it_names_exists() -> None:
    paths = set(re.findall(r"`((?:medley/)?[\w]+/[\w*/.-]*)`", DOC))
    assert len(paths) > 40
    for path in paths:
        if path.startswith(("docs/", "tests/", "src/")):
            assert (ROOT / path).exists(), path
            continue
        path = path.removeprefix("medley/")
        found = list(SRC.glob(path.rstrip("/")))
        assert found, f"docs/architecture.md names `{path}`, which is not under src/medley"


def test_the_search_modules_it_lists_exist() -> None:
    listed = re.search(r"the modules it calls: (.*?)\)", DOC)
    assert listed is not None
    for name in re.findall(r"`(\w+)`", listed.group(1)):
        assert (SRC / "plan" / f"{name}.py").exists(), f"plan/{name}.py"


def test_every_object_it_names_in_a_module_exists() -> None:
    named = re.findall(r"`([\w/]+)\.py`'s `(\w+)`", DOC)
    assert len(named) >= 4
    for path, name in named:
        module = importlib.import_module("medley." + path.replace("/", "."))
        assert hasattr(module, name), f"{path}.py has no {name}"
