"""Fidelity of the simulator against medley's runtime on this machine (CPU, gloo, 2-4 ranks).

    .venv/bin/python bench/fidelity.py [--quick] [--steps 20] [--reuse-profiles] [--cases a,b] [--name N]

Profiles the models (layers, gloo collectives, the runtime's overhead per action and per
transfer), then for each plan of medley.fidelity.cases.default_cases() (written-out plans
and `medley plan`'s own top plans on small emulated clusters): simulates one step on the emulated
CPU cluster, trains the plan for real with emulation on, and compares step time and peak memory
per rank, and replays each measured step's own compute durations in the simulator (docs/fidelity.md).
Writes bench/results/fidelity.json and fidelity.md (``--quick``: fidelity-quick.*, two
plans); the Markdown is rendered from the JSON alone, with the commit and command that made it.
The process raises its own priority when allowed (the machine is shared; other jobs only add noise).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from provenance import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two plans only (fidelity-quick.*)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reuse-profiles", action="store_true",
                        help="use bench/results/profile-cpu-*.json as they are (no re-profiling per case)")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="",
                        help="results file name (default fidelity, or fidelity-quick with --quick)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the Markdown from the JSON, running nothing")
    args = parser.parse_args()
    name = args.name or ("fidelity-quick" if args.quick else "fidelity")
    if args.render_only:
        from medley.fidelity.fidelity_report import markdown_from_payload

        payload = json.loads((args.out / f"{name}.json").read_text())
        (args.out / f"{name}.md").write_text(markdown_from_payload(payload))
        return
    try:
        os.nice(-15)
    except OSError:
        pass  # not allowed here: run at normal priority
    from medley.fidelity.harness import default_cases, quick_cases, run_harness

    cases = quick_cases() if args.quick else default_cases()
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = sorted(wanted - {c.name for c in default_cases()})
        if unknown:
            parser.error(f"--cases: unknown {unknown}")
        cases = [c for c in default_cases() if c.name in wanted]
    meta = provenance() | {"quick": args.quick, "cases_asked": args.cases or "all"}
    results = run_harness(cases, args.out, name=name, steps=args.steps, reuse_profiles=args.reuse_profiles,
                          meta=meta, progress=lambda line: print(line, flush=True))
    for r in results:
        print(f"{r.case:42s} predicted {r.predicted_step_s * 1e3:7.1f} ms  "
              f"fastest {r.fastest_step_s * 1e3:7.1f} ({r.fastest_step_error:+.0%})  "
              f"median {r.measured_step_s * 1e3:7.1f} ({r.step_error:+.0%})  "
              f"replay {r.replay_error:+.1%}  "
              f"memory worst {r.worst_memory_error:+.1%}")
    print(f"wrote {args.out / (name + '.json')} and {args.out / (name + '.md')}")


if __name__ == "__main__":
    main()
