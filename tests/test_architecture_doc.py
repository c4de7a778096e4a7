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


def test_the_plan_lowering_and_search_rows_name_every_module() -> None:
    # The three packages that were one: every module of plan and lowering, every module and stage
    # folder of search is on the map, so a newcomer finds where the search starts and each stage.
    for package in ("plan", "lowering"):
        for path in (SRC / package).glob("*.py"):
            if path.name != "__init__.py":
                assert f"`{package}/{path.name}`" in DOC, f"{package}/{path.name}"
    for path in (SRC / "search").iterdir():
        if path.suffix == ".py" and path.name != "__init__.py":
            assert f"`search/{path.name}`" in DOC, f"search/{path.name}"
        elif path.is_dir() and (path / "__init__.py").exists():
            assert f"`search/{path.name}/`" in DOC, f"search/{path.name}/"


def test_every_object_it_names_in_a_module_exists() -> None:
    named = re.findall(r"`([\w/]+)\.py`'s `(\w+)`", DOC)
    assert len(named) >= 4
    for path, name in named:
        module = importlib.import_module("medley." + path.replace("/", "."))
        assert hasattr(module, name), f"{path}.py has no {name}"
