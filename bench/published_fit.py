"""Fit the catalog's calibration on the calibration half of bench/published_runs.toml.

Run: .venv/bin/python bench/published_fit.py   (prints the fitted figures per GPU family as TOML
lines for src/medley/spec/devices.toml, and writes bench/results/published_fit.json with the
commit and command; the held-out half is never read)

Per family of catalog types sharing a chip (A100 40/80 GB; H100 SXM; a row's derived type, such as
the data file's power-limited H100, inherits its base's figures and is not fitted on),
coordinate descent over grids of ``matmul_efficiency``, ``attention_efficiency``,
``memory_efficiency`` and ``kernel_overhead_us`` minimises the sum of squared log(predicted /
measured) tokens/s over the family's calibration rows, each row simulated as bench/published.py
does.
"""

from __future__ import annotations

import json
import math
import sys

from provenance import provenance
from published import RESULTS, load_runs, predict

FAMILIES = {"A100": ("A100-80GB", "A100-40GB"), "H100": ("H100-SXM-80GB",)}
GRIDS = {
    "matmul_efficiency": [round(0.4 + 0.025 * i, 3) for i in range(23)],
    "attention_efficiency": [round(0.1 + 0.05 * i, 2) for i in range(17)],
    "memory_efficiency": [round(0.2 + 0.05 * i, 2) for i in range(16)],
    "kernel_overhead_us": [2.0, 5.0, 10.0, 20.0, 40.0],
}
START = {"matmul_efficiency": 0.75, "attention_efficiency": 0.75, "memory_efficiency": 0.8,
         "kernel_overhead_us": 5.0}
PASSES = 3


def loss(runs: list, device_types: dict, types: tuple[str, ...], figures: dict) -> float:
    """Sum of squared log ratios of ``runs`` with ``figures`` on every type of the family."""
    overrides = {t: figures for t in types}
    return sum(math.log(predict(run, device_types, overrides)["ratio"]) ** 2 for run in runs)


def fit(runs: list, device_types: dict, types: tuple[str, ...]) -> tuple[dict, float]:
    figures, best = dict(START), loss(runs, device_types, types, START)
    for _ in range(PASSES):
        moved = False
        for name, grid in GRIDS.items():
            for value in grid:
                trial = {**figures, name: value}
                score = loss(runs, device_types, types, trial)
                if score < best - 1e-12:
                    figures, best, moved = trial, score, True
        if not moved:
            break
    return figures, best


def main() -> int:
    runs, data = load_runs()
    device_types = data.get("device_types", {})
    out: dict = {**provenance(), "families": {}}
    for family, types in FAMILIES.items():
        # Rows on the family's own catalog types only: a derived type (the data file's H100 at a
        # 500 W power limit) inherits the family's figures but is not fitted on.
        rows = [r for r in runs if r.half == "calibration" and r.gpu in types]
        figures, score = fit(rows, device_types, types)
        out["families"][family] = {"types": list(types), "rows": [r.id for r in rows], "figures": figures,
                                   "rms_log_error": math.sqrt(score / len(rows))}
        print(f"# {family} ({', '.join(types)}): {len(rows)} calibration rows, rms log error "
              f"{math.sqrt(score / len(rows)):.3f}")
        for name, value in figures.items():
            print(f"{name} = {value}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "published_fit.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
