"""Write fidelity results as JSON and a Markdown table (bench/results/fidelity.*)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from medley.profile.fidelity import FidelityResult, summarize


def machine() -> dict[str, Any]:
    return {"host": socket.gethostname(), "cores": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "python": platform.python_version(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def result_row(r: FidelityResult) -> dict[str, Any]:
    row = dataclasses.asdict(r)
    row["predicted_memory"] = {str(k): v for k, v in r.predicted_memory.items()}
    row["measured_memory"] = {str(k): v for k, v in r.measured_memory.items()}
    row.update(step_error=r.step_error, fastest_step_error=r.fastest_step_error,
               loaded_step_error=r.loaded_step_error,
               memory_errors={str(k): v for k, v in r.memory_errors.items()})
    return row


def markdown(results: Sequence[FidelityResult], meta: dict[str, Any], notes: str = "") -> str:
    summary = summarize(results)
    lines = [
        "# Fidelity: simulator prediction vs medley's runtime on this machine",
        "",
        f"Machine: {meta.get('host')}, {meta.get('cores')} cores, torch {meta.get('torch')}; "
        f"date {meta.get('date', '?')}. Profiles: {', '.join(meta.get('profiles', []))}.",
        "",
        "| case | plan | predicted ms | fastest ms | err | median ms | err | loaded pred ms | err "
        "| bg cores | peak MB pred / meas per rank | worst mem err |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        memory = " · ".join(f"{r.predicted_memory.get(d, 0) / 1e6:.2f}/{m / 1e6:.2f}"
                            for d, m in sorted(r.measured_memory.items()))
        lines.append(
            f"| {r.case} | {r.plan} | {r.predicted_step_s * 1e3:.1f} | {r.fastest_step_s * 1e3:.1f} "
            f"| {_pct(r.fastest_step_error)} | {r.measured_step_s * 1e3:.1f} | {_pct(r.step_error)} "
            f"| {r.loaded_predicted_step_s * 1e3:.1f} | {_pct(r.loaded_step_error)} "
            f"| {r.background_cores:.2f} | {memory} | {_pct(r.worst_memory_error)} |")
    lines += [
        "",
        f"Median |error| of step time: {summary['median_abs_fastest_step_error']:.1%} against the "
        f"fastest step (worst {summary['worst_abs_fastest_step_error']:.1%}), "
        f"{summary['median_abs_step_error']:.1%} against the median step "
        f"(worst {summary['worst_abs_step_error']:.1%}), "
        f"{summary['median_abs_loaded_step_error']:.1%} for the load-aware prediction against the median "
        f"(worst {summary['worst_abs_loaded_step_error']:.1%}). Peak memory: median |error| "
        f"{summary['median_abs_memory_error']:.1%}, worst {summary['worst_abs_memory_error']:.1%}.",
        "",
    ]
    if notes:
        lines += [notes.strip(), ""]
    return "\n".join(lines)


def results_from_json(path: Path) -> tuple[list[FidelityResult], dict[str, Any]]:
    """The results and metadata of a written report (to render it again)."""
    payload = json.loads(Path(path).read_text())
    names = {f.name for f in dataclasses.fields(FidelityResult)}
    results = []
    for row in payload["results"]:
        fields = {k: v for k, v in row.items() if k in names}
        for key in ("predicted_memory", "measured_memory"):
            fields[key] = {int(d): float(b) for d, b in fields[key].items()}
        results.append(FidelityResult(**fields))
    return results, payload["meta"]


def write_report(results: Sequence[FidelityResult], meta: dict[str, Any], *, json_path: Path, md_path: Path,
                 notes: str = "") -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "summary": summarize(results), "results": [result_row(r) for r in results]}
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(markdown(results, meta, notes))
