"""The suite's layout: test folders are not packages, so pytest imports every test module by its basename."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_module_basenames_are_unique() -> None:
    # Two test_x.py in different folders collide in rootdir import mode ("import file mismatch"),
    # and only on a clean clone: a stale __pycache__ in a working tree can hide it.
    names = Counter(path.name for path in TESTS.rglob("*.py") if path.name != "conftest.py")
    assert [name for name, count in names.items() if count > 1] == []
