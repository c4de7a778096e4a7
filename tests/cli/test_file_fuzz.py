"""Issue #11: mutated cluster, plan and profile files (types, signs, sizes, missing and extra keys)
never crash the CLI. Each run ends in exit 0 (the mutation was valid) or exit 2 with one line on
stderr, never a traceback, within 5 s. Seeds: examples/*.toml, the documented plan example and
tests/data/tiny-profile.json. Run in-process with typer's CliRunner."""

from __future__ import annotations

import json
import math
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from medley.cli.main import app

ROOT = Path(__file__).parents[2]
WIDE = {"COLUMNS": "1000"}  # rich must not wrap a one-line error
# Examples per file kind: the tests stay under ~30 s on 2 cores (MEDLEY_FUZZ_EXAMPLES=500: a longer,
# randomised hunt).
EXAMPLES = int(os.environ.get("MEDLEY_FUZZ_EXAMPLES", "12"))

VALUES = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3.0, -2.5, 0.5, True, False, "", "4", "x", "A100-80GB", "nvlink",
                     10**9, 65537, 2**63, math.inf, -math.inf, math.nan, 1e308, [], [1, 2], {}, {"a": 1}]),
    st.integers(-3, 100),
    st.floats(-1e3, 1e3, allow_nan=False),
    st.text(max_size=8),
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in the document (tables, lists and leaves), as key/index paths."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*prefix, i))
    return out


def _mutate(doc: Any, path: tuple, op: str, value: Any) -> Any:
    """``doc`` with the position ``path`` replaced by ``value``, deleted, or given an extra key."""
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif isinstance(parent[last], dict):
        parent[last]["extra_key"] = value
    else:
        parent[last] = [parent[last], value]  # a scalar where a list was not expected, or vice versa
    return doc


def _check(args: list[str]) -> None:
    start = time.monotonic()
    result = CliRunner(env=WIDE).invoke(app, args)
    elapsed = time.monotonic() - start
    assert "Traceback" not in result.output, result.output
    assert result.exit_code in (0, 2), (result.exit_code, result.output, repr(result.exception))
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
    assert elapsed < 5, (elapsed, args)


def _fuzz(
    seed: Path, load: Callable[[str], Any], dump: Callable[[Any], str], args: Callable[[Path], list[str]]
) -> Callable[[Path], None]:
    """A hypothesis test mutating ``seed`` once per example and running the command on it."""
    doc = load(seed.read_text())
    paths = _paths(doc)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize="MEDLEY_FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(path=st.sampled_from(paths), op=st.sampled_from(["replace", "delete", "extra"]), value=VALUES)
    def run(tmp_path: Path, path: tuple, op: str, value: Any) -> None:
        mutated = _mutate(load(seed.read_text()), path, op, value)
        target = tmp_path / f"mutated{seed.suffix}"
        try:
            target.write_text(dump(mutated))
        except (TypeError, ValueError):  # a value the format cannot hold (NaN keys, ...): nothing to run
            return
        _check(args(target))

    return run


def _toml_dump(doc: Any) -> str:
    return tomli_w.dumps(doc)


def _plan_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    text = (ROOT / "docs" / "plan-format.md").read_text()
    path = tmp_path_factory.mktemp("seed") / "plan.toml"
    path.write_text(text.split("```toml\n", 1)[1].split("```", 1)[0])
    return path


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.toml")))
def test_mutated_cluster_files(tmp_path: Path, example: str) -> None:
    run = _fuzz(ROOT / "examples" / example, tomllib.loads, _toml_dump, lambda p: ["cluster", "show", str(p)])
    run(tmp_path)


def test_mutated_plan_files(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    seed = _plan_seed(tmp_path_factory)
    _check(["show", str(seed)])  # the seed itself is valid
    _fuzz(seed, tomllib.loads, _toml_dump, lambda p: ["show", str(p)])(tmp_path)


def test_mutated_profile_files(tmp_path: Path) -> None:
    def args(path: Path) -> list[str]:
        return ["simulate", "--cluster", "2xCPU-8GB", "--model", "tiny", "--profile", str(path), "--pp", "2",
                "--split", "2,2", "--seq-len", "64", "--micro-batches", "2", "--dtype", "fp32"]

    seed = ROOT / "tests" / "data" / "tiny-profile.json"
    _check(args(seed))
    _fuzz(seed, json.loads, lambda d: json.dumps(d, allow_nan=True), args)(tmp_path)
