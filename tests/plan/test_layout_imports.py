"""Reading a plan does not load the cost model or the simulator: the runtime builds its ranks
from :mod:`medley.plan.layout` and :mod:`medley.plan.plan` only, and no module of
:mod:`medley.runtime` loads the simulator (checked in a fresh interpreter, so that modules other
tests imported do not hide an import). The preflight memory check and the precision note of
``medley train`` do simulate, on purpose, in the command line (:mod:`medley.cli.preflight`) before
the ranks start. The schedule's ZeRO placement reads the
one table of ZeRO semantics (:mod:`medley.cost.zero_levels`), the runtime the dtypes of the
memory model (:mod:`medley.cost.zero_memory`) and both the recomputation settings
(:mod:`medley.cost.recompute`): definitions, without a cost model."""

from __future__ import annotations

import subprocess
import sys

import pytest

FORBIDDEN = ("medley.sim", "medley.cost", "medley.lowering", "medley.search")
# Definitions the runtime shares with the cost model: the ZeRO table, the memory model's dtypes, the
# recomputation settings and the closed-form FLOPs a training log's MFU divides by.
ALLOWED = ("medley.cost", "medley.cost.interfaces", "medley.cost.zero_levels", "medley.cost.zero_memory",
           "medley.cost.recompute", "medley.cost.formulas")


@pytest.mark.parametrize("module", ["medley.plan.layout", "medley.plan.plan", "medley.runtime.setup",
                                    "medley.runtime.train", "medley.launch.spawn"])
def test_plan_reading_path_imports_no_simulator(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}) and m not in {ALLOWED!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"


def test_no_runtime_module_loads_the_simulator() -> None:
    """Every module under medley.runtime, imported together: none of them pulls in the simulator or
    the lowering to it or any search module (the cost model's definitions the runtime shares are allowed)."""
    code = (
        "import importlib, pkgutil, sys, medley.runtime\n"
        "for info in pkgutil.walk_packages(medley.runtime.__path__, 'medley.runtime.'):\n"
        "    importlib.import_module(info.name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}) and m not in {ALLOWED!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"medley.runtime pulls in {out.stdout.strip()}"
