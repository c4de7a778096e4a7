"""medley's runtime against torch's own schedule classes, and peak memory by ZeRO level.

    .venv/bin/python bench/runtime.py [--rounds 4] [--steps 4] [--reuse-profiles]

1. Step time of medley's executor vs torch's ``Schedule1F1B`` / ``ScheduleGPipe`` with
   ``PipelineStage`` on the same stage modules, data and micro-batches (pp=2 dp=1; pp=2 dp=2 with a
   flat gradient all-reduce per stage, as medley's ZeRO-0 does), both in one launch, alternating
   rounds; ratio of median (and of fastest) step times. Goal: ratio <= 1.03.
2. Peak memory per rank by ZeRO level (0-3, dp=2; and pp=2 x dp=2) measured by the runtime's
   live-tensor probe (medley.runtime.memory), against the simulator's prediction from the CPU profile.

Writes bench/results/runtime.json and bench/results/runtime.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch.multiprocessing as mp
from provenance import provenance

OUT = Path(__file__).parent / "results"


def overhead_cases(profiles: dict, emulated: Path) -> list:
    from medley.fidelity.harness import SMALL, TINY
    from medley.fidelity.plans import FidelityCase, build_plan
    from medley.profile.runtime_bench import RuntimeCase

    specs = [
        FidelityCase(name="tiny pp2 1F1B", model=TINY, pp=2, dp=1, split="2,2", zero="0,0"),
        FidelityCase(
            name="tiny pp2 GPipe", model=TINY, pp=2, dp=1, schedule="gpipe", split="2,2", zero="0,0"
        ),
        FidelityCase(
            name="small pp2 1F1B", model=SMALL, pp=2, dp=1, split="2,2", zero="0,0", micro_batch_size=1
        ),
        FidelityCase(name="tiny pp2 dp2 1F1B", model=TINY, pp=2, dp=2, split="2,2", zero="0,0"),
        FidelityCase(
            name="small pp2 dp2 1F1B", model=SMALL, pp=2, dp=2, split="2,2", zero="0,0", micro_batch_size=1
        ),
    ]
    cases = []
    for spec in specs:
        profile, name = profiles[spec.model.name]
        plan, _ = build_plan(spec, profile, profile_name=name, directory=emulated, cores=os.cpu_count() or 1)
        cases.append(RuntimeCase(name=spec.name, plan=plan))
    return cases


def memory_cases() -> list:
    from medley.fidelity.harness import SMALL
    from medley.fidelity.plans import FidelityCase

    cases = [
        FidelityCase(name=f"small dp2 ZeRO-{z}", model=SMALL, pp=1, dp=2, zero=str(z), micro_batch_size=1)
        for z in range(4)
    ]
    cases += [
        FidelityCase(
            name=f"small pp2 dp2 ZeRO-{z}",
            model=SMALL,
            pp=2,
            dp=2,
            split="2,2",
            zero=f"{z},{z}",
            micro_batch_size=1,
        )
        for z in range(4)
    ]
    return cases


def run_overhead(cases: list, rounds: int, steps: int, tmp: Path) -> dict:
    from medley.launch.nodes import free_port
    from medley.profile.runtime_bench import overhead, worker

    results = {}
    for world in sorted({c.plan.world_size for c in cases}):
        out = tmp / f"runtime_{world}.json"
        mp.start_processes(
            worker,
            args=(world, free_port(), cases, rounds, steps, str(out)),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        results.update(
            {name: overhead(v) | {"world": world} for name, v in json.loads(out.read_text()).items()}
        )
    return results


def markdown(overheads: dict, memory: list, meta: dict) -> str:
    lines = [
        "# medley runtime vs torch's schedule classes; peak memory by ZeRO level",
        "",
        f"Machine: {meta['host']}, {meta['cores']} cores, torch {meta['torch']}, {meta['date']}; "
        f"{meta['rounds']} rounds x {meta['steps']} steps per side, alternating.",
        f"Commit {meta['commit']}; command `{meta['command']}`.",
        "",
        "| configuration | ranks | medley median ms | torch median ms | ratio | medley fastest ms "
        "| torch fastest ms | ratio of fastest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, o in overheads.items():
        lines.append(
            f"| {name} | {o['world']} | {o['medley_step_s'] * 1e3:.1f} | {o['torch_step_s'] * 1e3:.1f} "
            f"| {o['ratio']:.3f} | {o['medley_min_s'] * 1e3:.1f} | {o['torch_min_s'] * 1e3:.1f} "
            f"| {o['ratio_of_minima']:.3f} |"
        )
    lines += ["", "| plan | rank: predicted / measured MB (error) |", "|---|---|"]
    for r in memory:
        cells = " · ".join(
            f"{d}: {r.predicted_memory[d] / 1e6:.1f} / {m / 1e6:.1f} ({r.memory_errors[d]:+.1%})"
            for d, m in sorted(r.measured_memory.items())
        )
        lines.append(f"| {r.case} | {cells} |")
    lines += ["", meta["notes"], ""]
    return "\n".join(lines)


NOTES = (
    "Memory: fp32 training with AdamW (4 B weights, 4 B gradients, 8 B moments per parameter; ZeRO-1 "
    "shards the moments, ZeRO-2 also the gradients, ZeRO-3 also the weights, over dp=2), measured "
    "activations and backward workspace from the CPU profile; measured = peak live tensor bytes of the "
    "runtime's probe step (medley.runtime.memory). Step times on a shared 2-core machine: other jobs "
    "add noise to both sides alike (alternating rounds)."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reuse-profiles", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    try:
        os.nice(-15)
    except OSError:
        pass
    from medley.fidelity.fidelity_report import machine, result_row
    from medley.fidelity.harness import TINY, profiles_for
    from medley.fidelity.loop import run_case
    from medley.fidelity.plans import FidelityCase

    args.out.mkdir(parents=True, exist_ok=True)
    emulated = Path(tempfile.mkdtemp(prefix="medley-emulated-"))  # generated device catalogs
    mem_cases = memory_cases()
    made = provenance()
    profiles = profiles_for([*mem_cases, FidelityCase(name="t", model=TINY, pp=2, dp=1)], args.out,
                            reuse=args.reuse_profiles, provenance=made)
    overheads = run_overhead(overhead_cases(profiles, emulated), args.rounds, args.steps, emulated)
    memory = []
    for case in mem_cases:
        profile, name = profiles[case.model.name]
        memory.append(run_case(case, profile, profile_name=name, directory=emulated, steps=3, warmup_steps=1))
    meta = machine() | made | {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "steps": args.steps,
        "notes": NOTES,
    }
    payload = {"meta": meta, "overhead": overheads, "memory": [result_row(r) for r in memory]}
    (args.out / "runtime.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / "runtime.md").write_text(markdown(overheads, memory, meta))
    print((args.out / "runtime.md").read_text())


if __name__ == "__main__":
    main()
