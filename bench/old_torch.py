"""The runtime tests on the oldest torch medley supports (outside CI, which keeps constraints.txt's).

Builds a side environment (a venv outside the checkout) with ``torch==<--torch>`` from the
machine's package index (on Linux x86_64 PyPI's wheel is the CUDA build, which also runs on CPU;
it pulls the nvidia-* packages, several GB) and the pure-Python packages at constraints.txt's
versions, then runs a subset of the runtime tests there against this checkout's source
(``PYTHONPATH=src``, nothing installed from the checkout), with a timeout. Writes
bench/results/old-torch.json and .md: the torch and CUDA versions, each test's outcome and time.

    python bench/old_torch.py                       # torch 2.11.0, the default subset
    python bench/old_torch.py --torch 2.12.0 --venv /tmp/medley-torch-2.12
    python bench/old_torch.py --tests tests/runtime/test_torch_compat.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results"

# The runtime tests that exercise what differs across torch versions: process groups in plan order,
# FSDP2's reduce-scatters, the split backward, DTensor/TP, tied weights, checkpoints, a whole run.
SUBSET = (
    "tests/runtime/test_torch_compat.py",
    "tests/runtime/test_split_backward.py",
    "tests/runtime/test_rank_placement.py",
    "tests/runtime/test_equality.py",
    "tests/runtime/test_zero_bytes.py",
    "tests/runtime/test_tied_pipeline.py",
    "tests/runtime/test_tp_equality.py",
    "tests/runtime/test_scattered_hops.py",
    "tests/runtime/test_recompute_equality.py",
    "tests/runtime/test_checkpoint_entries.py",
    "tests/runtime/test_train.py",
)
# What the tests import besides torch (pyproject's dependencies and dev tools, at constraints.txt's
# versions); transformers and tensorboard are left out (their tests are not in the subset).
PACKAGES = ("numpy", "scipy", "pydantic", "typer", "rich", "matplotlib", "tomli-w", "tokenizers",
            "safetensors", "pyarrow", "pytest", "pytest-timeout", "hypothesis")


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "is ignored" not in line]
        raise SystemExit("pip install failed:\n" + "\n".join(lines[-30:]))


def build(venv: Path, torch_version: str) -> Path:
    """The side environment's python, made (or completed) with ``torch_version``."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    have = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True).stdout.strip()
    if have.split("+")[0] != torch_version:
        _pip(python, f"torch=={torch_version}")
    constraints = venv / "constraints-without-torch.txt"
    constraints.write_text("".join(line + "\n" for line in (ROOT / "constraints.txt").read_text().splitlines()
                                   if not line.startswith("torch==")))
    _pip(python, "-c", str(constraints), *PACKAGES)
    # The `medley` command some tests start, from this checkout's source (PYTHONPATH), as the entry
    # point of an installed medley would be; nothing is installed from the checkout.
    launcher = venv / "bin" / "medley"
    launcher.write_text(f"#!{python}\nfrom medley.cli.main import app\n\napp()\n")
    launcher.chmod(0o755)
    return python


def _versions(python: Path) -> dict[str, str | None]:
    code = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"
    torch_version, cuda = json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                                                    check=True).stdout.splitlines()[-1])
    return {"torch": torch_version, "cuda_build": cuda}


def run_tests(python: Path, tests: list[str], timeout_s: int, junit: Path) -> tuple[int | None, float, str]:
    """pytest on ``tests`` in the side environment (return code, None when killed at the timeout)."""
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    started = time.perf_counter()
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, tail = done.returncode, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        code, tail = None, out[-4000:]
    return code, time.perf_counter() - started, tail


def outcomes(junit: Path) -> list[dict]:
    """Each test's outcome (passed, failed, error, skipped), seconds and first failure line."""
    if not junit.exists():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = "failed" if kind == "failure" else kind
                message = (found.get("message") or "").splitlines()[0][:200] if found.get("message") else ""
                break
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": round(float(case.get("time") or 0.0), 2), "message": message})
    return rows


def markdown(result: dict) -> str:
    counts = result["counts"]
    lines = [f"# The runtime tests on torch {result['torch']} (CUDA build {result['cuda_build']}), on CPU",
             "", f"Commit `{result['commit']}`; command `{result['command']}`.", "",
             f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('error', 0)} "
             f"errors, {counts.get('skipped', 0)} skipped in {result['seconds']:.0f} s"
             + (" (stopped at the timeout)" if result["timed_out"] else "") + ".", "",
             "| test | outcome | s | first line of the failure |", "|---|---|---|---|"]
    lines += [f"| `{r['test']}` | {r['outcome']} | {r['seconds']} | {r['message'].replace('|', '/')} |"
              for r in result["tests"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", default="2.11.0", help="the torch release to test (default: the oldest "
                        "pyproject.toml accepts)")
    parser.add_argument("--venv", type=Path, default=Path("/tmp/medley-old-torch"),
                        help="the side environment (made if missing, outside the checkout)")
    parser.add_argument("--tests", nargs="*", default=list(SUBSET))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for the whole test run")
    args = parser.parse_args()
    if args.venv.resolve().is_relative_to(ROOT):
        raise SystemExit(f"--venv {args.venv} is inside the checkout; give a folder outside it")
    python = build(args.venv, args.torch)
    junit = args.venv / "old-torch-junit.xml"
    junit.unlink(missing_ok=True)
    code, seconds, tail = run_tests(python, args.tests, args.timeout, junit)
    rows = outcomes(junit)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    result = {**provenance(), **_versions(python), "tests_run": args.tests, "pytest_returncode": code,
              "timed_out": code is None, "seconds": round(seconds, 1), "counts": counts, "tests": rows,
              "output_tail": tail}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "old-torch.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "old-torch.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
