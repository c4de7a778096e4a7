"""The GPU check's checks (the issue's figures) and its Markdown (bench/gpu_check.py)."""

from __future__ import annotations

from typing import Any


def _check(name: str, passed: bool | None, figure: str, detail: str = "") -> dict[str, Any]:
    return {"check": name, "passed": passed, "figure": figure, "detail": detail}


def _mem(row: dict | None) -> float | None:
    values = [v for v in ((row or {}).get("peak_memory_bytes") or {}).values() if v]
    return max(values) if values else None


def checks(report: dict) -> list[dict[str, Any]]:
    """medley's tokens/s at least the plain loop's (eager against eager, compiled against compiled),
    MFU, predicted/measured step time within 10% and peak memory within 10%, never under-predicted;
    the refusal; the interleaved losses. ``passed`` is None where a figure is missing."""
    out = []
    for name, case in report["cases"].items():
        plain = (case.get("plain") or {}).get("phases", {})
        for kind in ("eager", "compiled"):
            mine, theirs = case["medley"].get(kind), plain.get(kind)
            if mine and theirs:
                ratio = mine["tokens_per_s"] / theirs["tokens_per_s"]
                out.append(
                    _check(
                        f"{name} {kind}: medley tokens/s >= plain loop's",
                        ratio >= 1.0,
                        f"{ratio:.3f}x ({mine['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f})",
                    )
                )
            else:
                out.append(
                    _check(
                        f"{name} {kind}: medley tokens/s >= plain loop's",
                        None,
                        "-",
                        "a run is missing (see steps)",
                    )
                )
            if mine:
                out.append(
                    _check(
                        f"{name} {kind}: MFU",
                        None,
                        f"{mine['mfu'] * 100:.1f}%",
                        "Megatron FLOPs over the catalog's dense bf16 peak",
                    )
                )
        measured = case["medley"].get("eager")
        for source, predicted in (case.get("predicted") or {}).items():
            if not predicted or not measured:
                continue
            ratio = predicted["step_time_s"] / measured["step_time_s"]
            out.append(
                _check(
                    f"{name}: predicted/measured step time ({source})", abs(ratio - 1) <= 0.10, f"{ratio:.3f}"
                )
            )
            pmem, mmem = _mem(predicted), _mem(measured)
            if pmem and mmem:
                out.append(
                    _check(
                        f"{name}: predicted/measured peak memory ({source})",
                        mmem <= pmem <= 1.10 * mmem,
                        f"{pmem / mmem:.3f}",
                        "under-predicted" if pmem < mmem else "",
                    )
                )
    refusal = report.get("refusal")
    if refusal:
        out.append(
            _check(
                "2-rank plan on one GPU: one line, exit 2",
                refusal["refused"],
                f"exit {refusal['rc']}, {refusal['stderr_lines']} line(s)",
                refusal["first_line"][:300],
            )
        )
    inter = report.get("interleaved")
    if isinstance(inter, list):
        for row in inter:
            if row:
                diff = row["max_rel_diff"]
                out.append(
                    _check(
                        f"interleaved v{row['virtual_stages']} ({row['backend']}) losses = one process's",
                        diff is not None and diff <= 1e-4 and row["same_length"],
                        "-" if diff is None else f"max rel diff {diff:.2e}",
                    )
                )
    return out


def fmt(value: float | None, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def markdown(report: dict) -> str:
    found = report.get("devices") or {}
    prov = report["provenance"]
    lines = [
        f"# GPU check ({report['device']})",
        "",
        f"{report['created']} on {report['host']}; commit {prov['commit']}; command `{prov['command']}`; "
        f"torch {found.get('torch')}, CUDA {found.get('cuda')}, NCCL {found.get('nccl', '-')}.",
        "",
        f"Verdict: {report['verdict']}.",
        "",
    ]
    if report["device"] == "cpu":
        lines += [
            "A dry run on CPU ranks with the tiny model: it exercises the script; its figures say nothing "
            "about a GPU.",
            "",
        ]
    if found.get("stand_in"):
        lines += [f"Catalog: {found['stand_in']}.", ""]
    for gpu in found.get("gpus", []):
        lines.append(
            f"- GPU {gpu['index']}: {gpu['name']}, {gpu['memory_bytes'] / 2**30:.0f} GiB, catalog "
            f"{gpu.get('catalog') or '-'} {gpu.get('mismatch') or gpu.get('error') or ''}"
        )
    lines += [
        "",
        "| case | run | step ms | tokens/s | MFU | peak GiB | outside steps s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, case in report["cases"].items():
        for source, row in (case.get("predicted") or {}).items():
            if row:
                lines.append(
                    f"| {name} | predicted ({source}) | {fmt(row['step_time_s'], 1e3)} | "
                    f"{fmt(row.get('tokens_per_s'), digits=0)} | {fmt(row.get('mfu'), 100, '%')} | "
                    f"{fmt(_mem(row), 2**-30, digits=2)} | - |"
                )
        for kind, row in case["medley"].items():
            if row:
                lines.append(
                    f"| {name} | medley {kind} | {fmt(row['step_time_s'], 1e3)} | "
                    f"{fmt(row['tokens_per_s'], digits=0)} | {fmt(row['mfu'], 100, '%')} | "
                    f"{fmt(_mem(row), 2**-30, digits=2)} | {fmt(row['outside_steps_s'])} |"
                )
        for kind, row in ((case.get("plain") or {}).get("phases") or {}).items():
            lines.append(
                f"| {name} | plain loop {kind} | {fmt(row['step_time_s'], 1e3)} | "
                f"{fmt(row['tokens_per_s'], digits=0)} | {fmt(row['mfu'], 100, '%')} | "
                f"{fmt(row['peak_memory_bytes'], 2**-30, digits=2)} | - |"
            )
    lines += ["", "| check | passed | figure | detail |", "| --- | --- | --- | --- |"]
    for row in report.get("checks") or []:
        passed = "-" if row["passed"] is None else ("yes" if row["passed"] else "NO")
        lines.append(
            f"| {row['check']} | {passed} | {row['figure']} | {str(row['detail']).replace('|', '/')} |"
        )
    lines += ["", "| step | seconds | result |", "| --- | --- | --- |"]
    for s in report["steps"]:
        result = s.get("skipped") or ("ok" if s.get("ok") else s.get("error", ""))
        if s.get("note"):
            result = f"{result}; {s['note']}"
        lines.append(f"| {s['step']} | {s.get('seconds', '-')} | {str(result).replace('|', '/')} |")
    return "\n".join(lines) + "\n"
