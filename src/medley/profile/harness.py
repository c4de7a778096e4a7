"""The fidelity harness end to end: profile the models, then predict and run every case, then report.

``bench/fidelity.py`` runs :func:`default_cases` (tiny and small models; pp, dp, uneven split,
1F1B / GPipe / ZB-H1 / interleaved, ZeRO 0-3, uneven micro-batches, emulated slow ranks, 2 and 4
ranks); the tests run two of them quickly.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from medley.cost.profiles import Profile, load_profile, save_profile
from medley.profile.fidelity import FidelityCase, FidelityResult, run_case
from medley.profile.report import machine, write_report
from medley.profile.run import run_profile
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

# A "small" LLaMA-style model: ~10x the tiny preset's compute per block, still seconds per run on CPU.
SMALL = ModelSpec(name="small", vocab_size=256, hidden_size=256, num_blocks=4, num_heads=8, num_kv_heads=4,
                  ffn_hidden_size=688, mlp="swiglu", norm="rmsnorm", position="rope", max_seq_len=256,
                  tied_embeddings=False, bias=False)
TINY = get_model("tiny")
PROFILE_RUNS = 9  # timed runs per layer and shape (medians of the faster half)


def default_cases() -> list[FidelityCase]:
    """Fourteen plans over both models."""
    tiny, small = TINY, SMALL
    return [
        FidelityCase(name="tiny-pp2-1f1b", model=tiny, pp=2, dp=1, split="2,2", zero="0,0"),
        FidelityCase(name="tiny-pp2-gpipe-uneven", model=tiny, pp=2, dp=1, schedule="gpipe", split="1,3",
                     zero="0,0"),
        FidelityCase(name="tiny-pp2-zbh1", model=tiny, pp=2, dp=1, schedule="zb-h1", split="2,2", zero="0,0"),
        FidelityCase(name="tiny-dp2-zero1", model=tiny, pp=1, dp=2, zero="1"),
        FidelityCase(name="tiny-dp2-zero3", model=tiny, pp=1, dp=2, zero="3"),
        FidelityCase(name="tiny-dp2-zero2-mb6+2", model=tiny, pp=1, dp=2, zero="2", micro_batches="6,2"),
        FidelityCase(name="tiny-pp2-slow2", model=tiny, pp=2, dp=1, split="3,1", zero="0,0",
                     slowdowns=(1.0, 2.0)),
        FidelityCase(name="small-pp2-1f1b", model=small, pp=2, dp=1, split="2,2", zero="0,0",
                     micro_batch_size=1),
        FidelityCase(name="small-dp2-zero2", model=small, pp=1, dp=2, zero="2", micro_batch_size=1),
        FidelityCase(name="small-pp2-slow1-zbh1", model=small, pp=2, dp=1, schedule="zb-h1", split="1,3",
                     zero="0,0", micro_batch_size=1, slowdowns=(2.0, 1.0)),
        FidelityCase(name="tiny-pp2-interleaved", model=tiny, pp=2, dp=1, schedule="interleaved",
                     split="1,1,1,1", zero="0,0,0,0"),
        FidelityCase(name="tiny-pp2dp2-zero1", model=tiny, pp=2, dp=2, split="2,2", zero="1,1"),
        FidelityCase(name="tiny-pp4-1f1b", model=tiny, pp=4, dp=1, split="1,1,1,1", zero="0,0,0,0",
                     micro_batches="8", micro_batch_size=1),
        FidelityCase(name="small-pp2dp2-zero3,2-mb6+2-slow", model=small, pp=2, dp=2, split="2,2",
                     zero="3,2", micro_batches="6,2", micro_batch_size=1, slowdowns=(1.0, 1.5, 1.0, 1.5)),
    ]


def harness_steps(cases: Sequence[FidelityCase], *, reuse_profiles: bool = False) -> int:
    """How many progress steps :func:`run_harness` reports at most (profiles it reuses are skipped)."""
    per_case = 1 if reuse_profiles else 2
    return len({c.model.name for c in cases}) + per_case * len(cases)


def profiles_for(cases: Sequence[FidelityCase], directory: Path, *, comm_ranks: Sequence[int] = (2, 4),
                 comm_sizes: Sequence[int] | None = None, runs: int = PROFILE_RUNS, reuse: bool = False,
                 progress: Callable[[str], None] | None = None) -> dict[str, tuple[Profile, str]]:
    """One CPU profile per model of ``cases``, at the shapes they use (collectives measured once)."""
    out: dict[str, tuple[Profile, str]] = {}
    comm = None
    for model in {c.model.name: c.model for c in cases}.values():
        name = f"profile-cpu-{model.name}.json"
        path = directory / name
        if reuse and path.exists():
            out[model.name] = (load_profile(path), name)
            continue
        shapes = [c for c in cases if c.model.name == model.name]
        if progress is not None:
            progress(f"profiling {model.name} on this CPU")
        profile = run_profile(model, micro_batch_sizes=sorted({c.micro_batch_size for c in shapes}),
                              seq_lens=sorted({c.seq_len for c in shapes}), runs=runs,
                              comm_ranks=() if comm is not None else comm_ranks, comm_sizes=comm_sizes)
        if comm is None:
            comm = profile.comm
        else:
            profile = profile.model_copy(update={"comm": comm})
        save_profile(profile, path)
        out[model.name] = (profile, name)
    return out


def run_harness(cases: Sequence[FidelityCase], out_dir: Path, *, name: str = "fidelity", steps: int = 20,
                reuse_profiles: bool = False, comm_sizes: Sequence[int] | None = None,
                notes: str = "", refresh_layers: bool | None = None,
                progress: Callable[[str], None] | None = None) -> list[FidelityResult]:
    """Profile, predict and run ``cases``; writes ``<name>.json`` and ``<name>.md`` to ``out_dir``.

    ``refresh_layers`` re-measures the case's layers right before its run (the collectives are
    measured once): on a shared machine the CPU's speed drifts 10-20% over minutes, which a
    profile taken at the start of a long harness run cannot see. It defaults to on unless
    ``reuse_profiles`` asks for the saved profiles as they are. ``progress(description)`` is called
    as each of :func:`harness_steps` steps starts."""
    if refresh_layers is None:
        refresh_layers = not reuse_profiles
    out_dir.mkdir(parents=True, exist_ok=True)
    profiles = profiles_for(cases, out_dir, reuse=reuse_profiles, comm_sizes=comm_sizes, progress=progress,
                            comm_ranks=sorted({2, *(c.world for c in cases if c.world > 1)}))
    step = progress or (lambda _description: None)
    results = []
    with tempfile.TemporaryDirectory(prefix="medley-emulated-") as emulated:  # generated device catalogs
        for case in cases:
            profile, profile_name = profiles[case.model.name]
            if refresh_layers:
                step(f"{case.name}: re-profiling its layers")
                fresh = run_profile(case.model, micro_batch_sizes=[case.micro_batch_size],
                                    seq_lens=[case.seq_len], runs=PROFILE_RUNS, comm_ranks=())
                profile = fresh.model_copy(update={"comm": profile.comm})
            step(f"{case.name}: simulating and training {steps} steps")
            results.append(run_case(case, profile, profile_name=profile_name, directory=Path(emulated),
                                    steps=steps, warmup_steps=min(5, steps // 2)))
    meta = machine() | {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "profiles": sorted({p for _, p in profiles.values()}), "steps": steps,
                        "niceness": os.nice(0)}
    write_report(results, meta, json_path=out_dir / f"{name}.json", md_path=out_dir / f"{name}.md",
                 notes=notes)
    return results
