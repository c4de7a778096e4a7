"""The fidelity harness end to end: profile the models, then predict and run every case, then report.

``bench/fidelity.py`` runs :func:`~medley.fidelity.cases.default_cases`; the tests run two
plans quickly. One profile per (model, precision) is measured first, with the gloo collectives
and the runtime's overhead measured once and shared by every profile.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from medley.cost.profile_format import Profile, load_profile, save_profile
from medley.fidelity.cases import SMALL, TINY, default_cases, quick_cases
from medley.fidelity.fidelity_report import machine, write_report
from medley.fidelity.loop import run_case
from medley.fidelity.plans import FidelityCase, NotRanked
from medley.fidelity.results import FidelityResult
from medley.profile.overhead import measure_overhead
from medley.profile.run import run_profile

PROFILE_RUNS = 9  # timed runs per layer and shape (medians of the faster half)

__all__ = [
    "PROFILE_RUNS",
    "SMALL",
    "TINY",
    "default_cases",
    "harness_steps",
    "profile_key",
    "profiles_for",
    "quick_cases",
    "run_harness",
]


def profile_key(case: FidelityCase) -> str:
    """Which profile a case reads: its model's, in its precision (fp32 keys are the model's name)."""
    return case.model.name if case.dtype == "fp32" else f"{case.model.name}-{case.dtype}"


def harness_steps(cases: Sequence[FidelityCase], *, reuse_profiles: bool = False) -> int:
    """How many progress steps :func:`run_harness` reports at most (profiles it reuses are skipped)."""
    per_case = 1 if reuse_profiles else 2
    return len({profile_key(c) for c in cases}) + per_case * len(cases)


def profiles_for(
    cases: Sequence[FidelityCase],
    directory: Path,
    *,
    comm_ranks: Sequence[int] = (2, 4),
    comm_sizes: Sequence[int] | None = None,
    runs: int = PROFILE_RUNS,
    reuse: bool = False,
    overhead: bool = True,
    provenance: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, tuple[Profile, str]]:
    """One CPU profile per :func:`profile_key` of ``cases``, at the shapes they use, saved as
    ``profile-cpu-<key>.json`` with ``provenance`` (a bench's commit and command). The collectives are
    measured once, the runtime's overhead (``overhead``) once per precision."""
    out: dict[str, tuple[Profile, str]] = {}
    comm = None
    overheads: dict[str, Any] = {}
    for key, first in {profile_key(c): c for c in cases}.items():
        name = f"profile-cpu-{key}.json"
        path = directory / name
        if reuse and path.exists():
            out[key] = (load_profile(path), name)
            continue
        shapes = [c for c in cases if profile_key(c) == key]
        if progress is not None:
            progress(f"profiling {key} on this CPU")
        profile = run_profile(
            first.model,
            micro_batch_sizes=sorted({s for c in shapes for s in c.profile_sizes}),
            seq_lens=sorted({c.seq_len for c in shapes}),
            runs=runs,
            dtype=first.dtype,
            comm_ranks=() if comm is not None else comm_ranks,
            comm_sizes=comm_sizes,
        )
        if comm is None:
            comm = profile.comm
        else:
            profile = profile.model_copy(update={"comm": comm})
        if overhead and first.dtype not in overheads:
            # Against the shared link fit, so that every profile's hand-off excess is the same one.
            overheads[first.dtype] = measure_overhead(dtype=first.dtype, comm=comm, runs=runs)
        profile = profile.model_copy(update={"overhead": overheads.get(first.dtype),
                                             "provenance": dict(provenance or {})})
        save_profile(profile, path)
        out[key] = (profile, name)
    return out


def run_harness(
    cases: Sequence[FidelityCase],
    out_dir: Path,
    *,
    name: str = "fidelity",
    steps: int = 20,
    reuse_profiles: bool = False,
    comm_sizes: Sequence[int] | None = None,
    refresh_layers: bool | None = None,
    meta: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[FidelityResult]:
    """Profile, predict and run ``cases``; writes ``<name>.json`` and ``<name>.md`` to ``out_dir``.

    ``refresh_layers`` re-measures the case's layers right before its run (the collectives and
    the overhead are measured once): on a shared machine the CPU's speed drifts 10-20% over
    minutes, which a profile taken at the start of a long harness run cannot see. It defaults to
    on unless ``reuse_profiles`` asks for the saved profiles as they are. ``meta`` joins the
    report's metadata (the bench's commit and command). ``progress(description)`` is called as
    each of :func:`harness_steps` steps starts."""
    if refresh_layers is None:
        refresh_layers = not reuse_profiles
    out_dir.mkdir(parents=True, exist_ok=True)
    profiles = profiles_for(
        cases,
        out_dir,
        reuse=reuse_profiles,
        comm_sizes=comm_sizes,
        progress=progress,
        comm_ranks=sorted({2, *(c.world for c in cases if c.world > 1)}),
        provenance={k: v for k, v in (meta or {}).items() if k in ("commit", "command")},
    )
    skipped: dict[str, str] = {}
    results = run_cases(cases, profiles, steps=steps, refresh_layers=refresh_layers, progress=progress,
                        skipped=skipped)
    report_meta = machine() | {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "profiles": sorted({p for _, p in profiles.values()}),
        "steps": steps,
        "niceness": os.nice(0),
        "skipped": skipped,
        "overhead": {
            key: p.overhead.model_dump(mode="json") if p.overhead else None
            for key, (p, _) in profiles.items()
        },
    }
    write_report(
        results,
        report_meta | dict(meta or {}),
        json_path=out_dir / f"{name}.json",
        md_path=out_dir / f"{name}.md",
    )
    return results


def run_cases(
    cases: Sequence[FidelityCase],
    profiles: Mapping[str, tuple[Profile, str]],
    *,
    steps: int,
    refresh_layers: bool,
    progress: Callable[[str], None] | None = None,
    skipped: dict[str, str] | None = None,
) -> list[FidelityResult]:
    """Predict and run every case with its profile (its layers re-measured first when asked); a
    planner case whose k-th plan the search did not rank is left out, its reason in ``skipped``."""
    step = progress or (lambda _description: None)
    results = []
    with tempfile.TemporaryDirectory(prefix="medley-emulated-") as emulated:  # generated device catalogs
        for case in cases:
            profile, profile_name = profiles[profile_key(case)]
            if refresh_layers:
                step(f"{case.name}: re-profiling its layers")
                fresh = run_profile(
                    case.model,
                    micro_batch_sizes=list(case.profile_sizes),
                    seq_lens=[case.seq_len],
                    runs=PROFILE_RUNS,
                    comm_ranks=(),
                    dtype=case.dtype,
                )
                profile = fresh.model_copy(update={"comm": profile.comm, "overhead": profile.overhead})
            step(f"{case.name}: simulating and training {steps} steps")
            try:
                results.append(run_case(case, profile, profile_name=profile_name, directory=Path(emulated),
                                        steps=steps, warmup_steps=min(5, steps // 2)))
            except NotRanked as err:
                step(f"{case.name}: skipped: {err}")
                if skipped is not None:
                    skipped[case.name] = str(err)
    return results
