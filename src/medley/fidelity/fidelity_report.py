"""Write fidelity results as JSON and a Markdown report (bench/results/fidelity.*).

The Markdown is rendered from the JSON payload alone (:func:`markdown`): every figure in its
prose, every median, the worst case and what its error comes from, is computed from the rows, so
the text cannot contradict the table. ``bench/fidelity.py --render-only`` re-renders a saved JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from medley.fidelity.replay_report import cores_lines, replay_lines
from medley.fidelity.results import FidelityResult, summarize
from medley.fileio import write_atomically

READING = """\
How to read this. *predicted*: the simulator on the emulated cluster (profile times x slowdown,
gloo α-β link, plus the runtime's overhead per compute action and per transfer that the profile
measured), assuming the cores serve only these ranks (with more ranks than cores, every compute is
stretched by Σ 1/slowdown / cores). *no ovh*: the same prediction without that overhead.
*fastest*: the fastest timed step (other jobs on a shared machine can only add time); *median*:
the median step; *loaded*: re-simulated with the background CPU load measured during the run (bg
cores). Errors are (predicted - measured) / measured. Memory: peak live tensor bytes per rank from
the runtime's probe step (medley.runtime.memory) against the simulator's peak. The plan column is
the plan as it ran (layers per stage include the embedding and the head); planner's plans are
the top-ranked plans of `medley plan` (its search) on the emulated cluster named by the case."""


def machine() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# The results' fields keyed by device id (strings in JSON).
_BY_DEVICE = ("predicted_memory", "measured_memory", "measured_by_device", "measured_actions_by_device")


def result_row(r: FidelityResult) -> dict[str, Any]:
    row = dataclasses.asdict(r)
    for key in _BY_DEVICE:
        row[key] = {str(k): v for k, v in getattr(r, key).items()}
    row.update(
        step_error=r.step_error,
        fastest_step_error=r.fastest_step_error,
        loaded_step_error=r.loaded_step_error,
        no_overhead_error=r.no_overhead_error,
        memory_errors={str(k): v for k, v in r.memory_errors.items()},
        compute_error=r.compute_error,
        rest_error=r.rest_error,
        replay_error=r.replay_error,
        replay_abs_error=r.replay_abs_error,
    )
    return row


def results_from_rows(rows: Sequence[dict[str, Any]]) -> list[FidelityResult]:
    """The results a payload's ``results`` rows hold."""
    names = {f.name for f in dataclasses.fields(FidelityResult)}
    results = []
    for row in rows:
        fields = {k: v for k, v in row.items() if k in names}
        for key in _BY_DEVICE:
            by_device = fields.get(key, {}).items()
            fields[key] = {int(d): b if isinstance(b, dict) else float(b) for d, b in by_device}
        results.append(FidelityResult(**fields))
    return results


def results_from_json(path: Path) -> tuple[list[FidelityResult], dict[str, Any]]:
    """The results and metadata of a written report (to render it again)."""
    payload = json.loads(Path(path).read_text())
    return results_from_rows(payload["results"]), payload["meta"]


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _table(results: Sequence[FidelityResult]) -> list[str]:
    lines = [
        "| case | plan | predicted ms | no ovh ms | fastest ms | err | no ovh err | median ms | err "
        "| loaded err | compute err | rest err | noise | bg cores | peak MB pred / meas per rank "
        "| worst mem err |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        memory = " · ".join(
            f"{r.predicted_memory.get(d, 0) / 1e6:.2f}/{m / 1e6:.2f}"
            for d, m in sorted(r.measured_memory.items())
        )
        lines.append(
            f"| {r.case} | {r.plan} | {_ms(r.predicted_step_s)} | {_ms(r.predicted_no_overhead_s)} "
            f"| {_ms(r.fastest_step_s)} | {_pct(r.fastest_step_error)} | {_pct(r.no_overhead_error)} "
            f"| {_ms(r.measured_step_s)} | {_pct(r.step_error)} | {_pct(r.loaded_step_error)} "
            f"| {_pct(r.compute_error)} | {_pct(r.rest_error)} | {_pct(r.compute_spread)} "
            f"| {r.background_cores:.2f} | {memory} "
            f"| {_pct(r.worst_memory_error)} |"
        )
    return lines


def _summary(results: Sequence[FidelityResult]) -> list[str]:
    s = summarize(results)
    under = sum(r.fastest_step_error < 0 for r in results)
    under_bare = sum(r.no_overhead_error < 0 for r in results)
    return [
        f"Step time over {len(results)} cases: median |error| "
        f"{s['median_abs_fastest_step_error']:.1%} against "
        f"the fastest step (worst {s['worst_abs_fastest_step_error']:.1%}; median signed error "
        f"{s['median_fastest_step_error']:+.1%}, {under} of {len(results)} under-predicted), "
        f"{s['median_abs_step_error']:.1%} against the median step (worst {s['worst_abs_step_error']:.1%}), "
        f"{s['median_abs_loaded_step_error']:.1%} for the load-aware prediction against the median step "
        f"(worst {s['worst_abs_loaded_step_error']:.1%}). Without the measured overhead the median |error| "
        f"against the fastest step is {s['median_abs_no_overhead_error']:.1%} (worst "
        f"{s['worst_abs_no_overhead_error']:.1%}; {under_bare} of {len(results)} under-predicted).",
        "",
        "Split on each case's busiest device (medians over the cases of the per-rank median step): "
        f"its compute (forward, backward and optimizer) is predicted {s['median_compute_error']:+.1%} "
        f"against the time the rank measured in those actions, and the rest of its step (bubble, "
        f"transfers, collectives, clipping) {s['median_rest_error']:+.1%} against the rest of its "
        "measured step (columns compute err and rest err).",
        "",
        *_noise(s),
        "Peak memory per rank: " + "; ".join(_memory_phrase(s, dtype) for dtype in ("fp32", "bf16")) + ".",
    ]


def _noise(summary: dict[str, float]) -> list[str]:
    median = summary["median_compute_spread"]
    if median != median:  # NaN: a report from before the compute was kept per step
        return []
    return [
        "Noise on identical work: the busiest device runs the same compute actions every step, yet "
        f"its compute took a median {median:+.1%} longer in its median step than in its fastest "
        f"(worst {summary['worst_compute_spread']:+.1%}; column noise). A step-time error below that "
        "cannot be told from the machine's own variation.",
        "",
    ]


def _memory_phrase(summary: dict[str, float], dtype: str) -> str:
    median = summary[f"median_abs_memory_error_{dtype}"]
    if median != median:  # NaN: no case in this precision
        return f"no {dtype} case"
    return f"median |error| {median:.1%} in {dtype} (worst {summary[f'worst_abs_memory_error_{dtype}']:.1%})"


def _by_tag(results: Sequence[FidelityResult]) -> list[str]:
    tags = sorted({t for r in results for t in r.tags})
    if not tags:
        return []
    lines = [
        "Where the step-time error lives (cases with each feature; errors against the fastest step):",
        "",
        "| feature | cases | median error | median abs error | worst abs error | median abs mem err |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for tag in tags:
        rows = [r for r in results if tag in r.tags]
        errors = [r.fastest_step_error for r in rows]
        memory = [abs(e) for r in rows for e in r.memory_errors.values()]
        lines.append(
            f"| {tag} | {len(rows)} | {_pct(_median(errors))} | {_median([abs(e) for e in errors]):.1%} "
            f"| {max(abs(e) for e in errors):.1%} | {_median(memory):.1%} |"
        )
    return lines


def explain_worst(r: FidelityResult) -> str:
    """The worst case's error in the terms of its own data: the simulator's breakdown of its
    busiest device against the measured gap."""
    b = r.breakdown
    gap = r.fastest_step_s - r.predicted_step_s
    comm = b.get("exposed_transfer_s", 0.0) + b.get("exposed_zero_s", 0.0) + b.get("exposed_clip_s", 0.0)
    compute = b.get("compute_s", 0.0)
    parts = [
        f"The worst step-time case is {r.case} ({r.plan}): predicted {_ms(r.predicted_step_s)} ms against "
        f"{_ms(r.fastest_step_s)} ms fastest ({_pct(r.fastest_step_error)}; median step "
        f"{_ms(r.measured_step_s)} ms)."
    ]
    if b:
        parts.append(
            f"On its busiest device (device {int(b['device'])}) the simulator's step is "
            f"{_ms(compute)} ms of compute ({int(b['compute_actions'])} compute actions, "
            f"{_ms(b['overhead_s'])} ms of them the measured per-action overhead), "
            f"{_ms(b['bubble_s'])} ms of bubble, {_ms(b['exposed_transfer_s'])} ms waiting on "
            f"transfers ({int(b['transfers'])} sent), {_ms(b['exposed_zero_s'])} ms on ZeRO collectives, "
            f"{_ms(b.get('exposed_clip_s', 0.0))} ms in the gradient-norm all-reduce and "
            f"{_ms(b.get('clip_barrier_s', 0.0))} ms waiting there for other ranks."
        )
        verb = "misses" if gap > 0 else "adds"
        share = [f"{abs(gap) / compute:.0%} of the predicted compute"] if compute > 0 else []
        if 0 < abs(gap) <= comm:
            share.append(f"{abs(gap) / comm:.0%} of the predicted exposed communication")
        parts.append(
            f"The prediction {verb} {_ms(abs(gap))} ms: " + (" or ".join(share) or "no modelled part") + "."
        )
        if gap > 0 and comm > 0 and abs(gap) > comm:
            parts.append(
                "The gap exceeds all the exposed communication the simulator predicts, so the compute "
                "(or waits the simulator does not see) must run slower than profiled."
            )
        elif gap > 0 and comm == 0:
            parts.append(
                "The simulator predicts no exposed communication here: the gap is compute running "
                "slower than profiled, or waits the simulator does not see."
            )
    device = int(b.get("device", -1)) if b else -1
    measured = r.measured_actions_by_device.get(device)
    if measured:
        waits = b["bubble_s"] + b["exposed_transfer_s"]
        parts.append(
            f"That device measured per step (medians) {_ms(r.measured_busy_s)} ms in "
            f"compute and optimizer actions against {_ms(b['compute_s'])} ms predicted "
            f"({_pct(r.compute_error)}), {_ms(measured['transfer'])} ms in transfers and waits for them "
            f"against {_ms(waits)} ms of predicted bubble and exposed transfer, {_ms(measured['zero'])} ms "
            f"in ZeRO collectives against {_ms(b['exposed_zero_s'])} ms exposed, and "
            f"{_ms(measured['clip'])} ms at the clipping all-reduce against "
            f"{_ms(b.get('exposed_clip_s', 0.0) + b.get('clip_barrier_s', 0.0))} ms."
        )
    if r.measured_by_device:
        slowest = max(r.measured_by_device, key=lambda d: r.measured_by_device[d])
        parts.append(
            f"Measured, rank {slowest} was slowest (median {_ms(r.measured_by_device[slowest])} ms); "
            f"background load during the run {r.background_cores:.2f} cores, emulation sleeps "
            f"{_ms(r.emulated_sleep_s)} ms per step (the load-aware prediction is "
            f"{_pct(r.loaded_step_error)} against the median step); without the overhead term the "
            f"prediction was {_ms(r.predicted_no_overhead_s)} ms ({_pct(r.no_overhead_error)})."
        )
    return " ".join(parts)


def _worst_memory(results: Sequence[FidelityResult]) -> str:
    rows = [(abs(e), r, d, e) for r in results for d, e in r.memory_errors.items()]
    if not rows:
        return ""
    _, r, device, error = max(rows, key=lambda row: row[0])
    return (
        f"The worst peak-memory case is {r.case} device {device}: predicted "
        f"{r.predicted_memory[device] / 1e6:.2f} MB against "
        f"{r.measured_memory[device] / 1e6:.2f} MB measured "
        f"({_pct(error)}, {r.dtype})."
    )


def _overhead(meta: dict[str, Any]) -> list[str]:
    lines = []
    for key, fit in sorted((meta.get("overhead") or {}).items()):
        if fit:
            figures = fit.get("figures", {})
            residual = figures.get("residual_per_action_s")
            signed = (
                "" if residual is None else f" (measured residual {residual * 1e6:+.0f} µs, clamped at 0)"
            )
            lines.append(
                f"- profile {key}: {fit['action_s'] * 1e6:.0f} µs per compute action{signed}, "
                f"{fit['p2p_handoff_s'] * 1e6:.0f} µs per transfer beyond the link "
                f"(hand-off measured {figures.get('handoff_s', 0.0) * 1e6:.0f} µs), "
                f"{fit.get('collective_s', 0.0) * 1e6:.0f} µs per ZeRO gather or reduction call beyond "
                "the link."
            )
        else:
            lines.append(f"- profile {key}: no overhead measured (predicted as 0).")
    return ["Runtime overhead the profiles measured (medley.profile.overhead):", "", *lines] if lines else []


def markdown_from_payload(payload: dict[str, Any]) -> str:
    """The report, from the JSON payload :func:`write_report` writes, and nothing else."""
    meta, results = payload["meta"], results_from_rows(payload["results"])
    title = "# Fidelity: simulator prediction vs medley's runtime on this machine"
    if meta.get("quick"):
        title += " (quick subset)"
    lines = [
        title,
        "",
        f"Machine: {meta.get('host')}, {meta.get('cores')} cores, torch {meta.get('torch')}; date "
        f"{meta.get('date', '?')}; {meta.get('steps', '?')} steps per case. Profiles: "
        f"{', '.join(meta.get('profiles', []))}.",
        f"Commit {meta.get('commit', 'not recorded')}; command `{meta.get('command', 'not recorded')}`.",
        *[f"Skipped {name}: {why}." for name, why in sorted((meta.get("skipped") or {}).items())],
        "",
        *_table(results),
        "",
        *_summary(results),
        "",
    ]
    if results:
        worst = max(results, key=lambda r: abs(r.fastest_step_error))
        lines += [explain_worst(worst), "", _worst_memory(results), ""]
    lines += [*_by_tag(results), "", *replay_lines(results), *cores_lines(results), *_overhead(meta), "",
              READING, ""]
    return "\n".join(lines)


def markdown(results: Sequence[FidelityResult], meta: dict[str, Any]) -> str:
    return markdown_from_payload(payload_of(results, meta))


def payload_of(results: Sequence[FidelityResult], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "summary": summarize(results), "results": [result_row(r) for r in results]}


def write_report(
    results: Sequence[FidelityResult], meta: dict[str, Any], *, json_path: Path, md_path: Path
) -> None:
    """Write the JSON, then render the Markdown from what was written."""
    text = json.dumps(payload_of(results, meta), indent=1) + "\n"
    write_atomically(json_path, text)
    write_atomically(md_path, markdown_from_payload(json.loads(text)))
