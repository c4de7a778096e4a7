"""How long the README's demo takes, as a new user runs it: ``scripts/demo.sh`` whole, without
its Hugging Face part (``--hf-steps 0``) and without the real CPU runs (``--train-steps 0``).

Run: ``.venv/bin/python bench/demo_time.py`` (about two minutes on 2 cores; writes
bench/results/demo_time.{json,md}). Wall seconds of each run, with the machine's load average
before it (this VM's 2 cores are shared). The README's demo figures are read from this file
(``tests/test_readme_figures.py`` checks that the README says what it measured).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).parents[1]
OUT = ROOT / "bench" / "results"
VARIANTS = {"whole": [], "no_hf": ["--hf-steps", "0"], "no_training": ["--train-steps", "0"]}


def timed(args: list[str], workdir: Path) -> dict[str, float]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run([str(ROOT / "scripts" / "demo.sh"), *args], cwd=workdir, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {"wall_s": round(time.perf_counter() - start, 1), "load_before": round(load, 1)}


def main() -> None:
    runs: dict[str, dict[str, float]] = {}
    for name, args in VARIANTS.items():
        with tempfile.TemporaryDirectory() as workdir:  # the demo writes out/ where it runs
            runs[name] = timed(args, Path(workdir))
        print(name, runs[name], flush=True)
    whole, no_hf, no_training = (runs[n]["wall_s"] for n in VARIANTS)
    data = {**provenance(), "cores": os.cpu_count(), "runs": runs,
            "hf_part_s": round(whole - no_hf), "without_training_s": round(no_training)}
    OUT.mkdir(exist_ok=True)
    (OUT / "demo_time.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# Demo time",
        "",
        f"Commit `{data['commit']}`, command `{data['command']}`; {data['cores']} cores (shared).",
        "",
        "| run | arguments | wall (s) | load average before |",
        "|---|---|---|---|",
        *(f"| {name} | `{' '.join(VARIANTS[name]) or '-'}` | {r['wall_s']} | {r['load_before']} |"
          for name, r in runs.items()),
        "",
        f"The Hugging Face part: {data['hf_part_s']} s (whole less `--hf-steps 0`); the demo without its "
        f"real CPU runs: {data['without_training_s']} s.",
    ]
    (OUT / "demo_time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
