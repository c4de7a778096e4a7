"""How long the README's demo takes, as a new user runs it: ``scripts/demo.sh`` (which sets up
or reuses .venv) into a fresh ``--out``, ``--repeats`` times.

Run: ``.venv/bin/python bench/demo_time.py [--repeats 3]`` (about a minute each on 2 cores; writes
bench/results/demo_time.{json,md}). Per run: the wall seconds of the whole command, the machine's
load average before it (this VM's 2 cores are shared) and the demo's own seconds per part
(``out/demo-times.json``: planning, ZIPPer, the real CPU run, the Hugging Face part). The README's
demo figures are the median run's (``tests/test_readme_figures.py`` checks that it says them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).parents[1]
OUT = ROOT / "bench" / "results"


def timed(out: Path) -> dict:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run([str(ROOT / "scripts" / "demo.sh"), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    parts = json.loads((out / "demo-times.json").read_text())
    return {"wall_s": round(wall, 1), "load_before": round(load, 1), "parts_s": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as workdir:
            runs.append(timed(Path(workdir) / "out"))
        print(runs[-1], flush=True)
    median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    parts = median["parts_s"]
    data = {**provenance(), "cores": os.cpu_count(), "runs": runs,
            "median": {"wall_s": round(median["wall_s"]), "hf_part_s": round(parts["hf"]),
                       "without_training_s": round(median["wall_s"] - parts["run"] - parts["hf"])},
            "spread_s": [min(r["wall_s"] for r in runs), max(r["wall_s"] for r in runs)]}
    OUT.mkdir(exist_ok=True)
    (OUT / "demo_time.json").write_text(json.dumps(data, indent=2) + "\n")
    names = list(runs[0]["parts_s"])
    lines = [
        "# Demo time",
        "",
        f"Commit `{data['commit']}`, command `{data['command']}`; {data['cores']} cores (shared).",
        "",
        f"| run | wall (s) | load average before | {' | '.join(f'{n} (s)' for n in names)} |",
        "|---|---|---|" + "---|" * len(names),
        *(f"| {i} | {r['wall_s']} | {r['load_before']} | {' | '.join(str(r['parts_s'][n]) for n in names)} |"
          for i, r in enumerate(runs)),
        "",
        f"Median run: {median['wall_s']:.0f} s, of which the Hugging Face part {parts['hf']:.0f} s; "
        "without the real CPU runs (`--train-steps 0`, which skips both) about "
        f"{data['median']['without_training_s']} s (the whole less the two parts, start-up included). "
        f"Runs spread {data['spread_s'][0]}-{data['spread_s'][1]} s.",
    ]
    (OUT / "demo_time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
