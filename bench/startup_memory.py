"""Start-up vs steady-state peak resident memory per rank (issue 28: no rank needs more memory to
start than to run).

    .venv/bin/python bench/startup_memory.py --label after [--cases zero3-dp4,zero3-dp2-tp2]
    PYTHONPATH=/work/main/src .venv/bin/python bench/startup_memory.py --label before   # old code

Each case is a ~270M-parameter LLaMA-shaped model (hidden 1024, 16 blocks, vocab 32000; 1.1 GB
in fp32) run on 4 CPU ranks (gloo, spawned) at ZeRO-3 with one bucket per layer, gathered per
micro-batch (``gather_windows=0``, the plan's leanest). Each rank reads its peak resident set
(``VmHWM`` of /proc/self/status) after building its stages (start-up), resets it (``5`` >
/proc/self/clear_refs), runs two SGD steps and reads it again (steady state). Plain SGD (no
optimizer state) keeps four ranks under ~6 GB on a shared machine; AdamW would add 8 bytes per
local parameter to the steady state. The check is the issue's: start-up peak <= steady-state
peak + the model's largest layer, unsharded. Results go to bench/results/startup_memory.{json,md}
under ``--label`` (other labels' rows are kept), each with the commit of the medley source it
ran and the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from provenance import provenance

SEQ, MBS, MICRO_BATCHES = 128, 1, 2
CASES = {"zero3-dp4": dict(dp=4, tp=None), "zero3-dp2-tp2": dict(dp=2, tp="2")}
MIB = 2 ** 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _spec():  # noqa: ANN202 - medley is imported in the ranks, after PYTHONPATH is applied
    from medley.spec.model_arg import get_model

    return dataclasses.replace(get_model("llama-2-7b"), name="startup-270m", hidden_size=1024, num_blocks=16,
                               num_heads=16, num_kv_heads=16, ffn_hidden_size=2816, max_seq_len=SEQ)


def _layout(case: str):  # noqa: ANN202
    from medley.cost.estimator import CatalogCostSource
    from medley.lowering.compile import compile_problem
    from medley.plan.inline import inline_layout
    from medley.spec.cluster_load import parse_cluster_arg

    cluster = parse_cluster_arg("4xA100-80GB")
    spec = _spec()
    cost = CatalogCostSource.for_cluster(spec, cluster)
    layout = inline_layout(cluster=cluster, model=spec, cost=cost, pp=1, dp=CASES[case]["dp"],
                           schedule="1f1b", micro_batches=str(MICRO_BATCHES), micro_batch_size=MBS,
                           seq_len=SEQ, zero="3", buckets=spec.num_layers, gather_windows=0, dtype="fp32",
                           tp=CASES[case]["tp"])
    return spec, layout, compile_problem(layout, cluster, cost)


def rank_main(rank: int, world: int, port: int, case: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from medley.data.source import MicroBatches
    from medley.runtime.executor import RankExecutor
    from medley.runtime.groups import make_groups
    from medley.runtime.stages import build_local_stages
    from medley.runtime.transformer import Decoder, token_loss_sum
    from medley.schedule.ir import with_default_collectives

    spec, layout, problem = _layout(case)
    groups = make_groups(tuple(tuple(layout.group(r, k) for k in range(layout.pp)) for r in range(layout.dp)))
    place = groups.place
    schedule = with_default_collectives(problem.schedules[place.replica])
    base = _status("VmRSS")
    stages = build_local_stages(spec, schedule=schedule, split=layout.stage_layers, zero=[3], groups=groups,
                                seed=0, optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(lr=1e-3))
    startup = _status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    n_tokens = layout.dp * MICRO_BATCHES * MBS * SEQ
    executor = RankExecutor(
        schedule=schedule, pipeline_rank=place.pipeline_rank, stages=stages, pipeline=groups.pipeline,
        tp_rank=place.tp_rank, tp_group=groups.tp_group, activation_shape=(MBS, SEQ, spec.hidden_size),
        loss_fn=token_loss_sum)
    gen = torch.Generator().manual_seed(place.replica)
    for _ in range(2):
        tokens = torch.randint(0, spec.vocab_size, (MICRO_BATCHES * MBS, SEQ + 1), generator=gen)
        chunks = tokens.split(MBS)
        executor.run_step(MicroBatches(inputs=[c[:, :-1] for c in chunks],
                                       targets=[c[:, 1:] for c in chunks], loss_tokens=n_tokens))
    steady = _status("VmHWM")
    with torch.device("meta"):
        whole = Decoder(spec, init=False)
    layer = max(sum(p.numel() * 4 for p in m.parameters()) for m in whole.layer_modules().values())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                for stage in stages.values() for bucket in stage.buckets for p in bucket)
    row = {"rank": rank, "baseline_mib": base / MIB, "startup_peak_mib": startup / MIB,
           "steady_peak_mib": steady / MIB, "largest_layer_mib": layer / MIB, "local_param_mib": local / MIB,
           "model_param_mib": sum(p.numel() * 4 for p in whole.parameters()) / MIB}
    row["startup_within_bound"] = startup <= steady + layer
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _medley_commit() -> str:
    """The commit of the medley source the ranks import (PYTHONPATH may point at another checkout)."""
    code = "import medley, pathlib; print(pathlib.Path(medley.__file__).parent)"
    def run(*command: str) -> str:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    where = run(sys.executable, "-c", code)
    dirty = run("git", "-C", where, "status", "--porcelain", ".")
    return run("git", "-C", where, "rev-parse", "HEAD") + ("+dirty" if dirty else "")


def markdown(payload: dict) -> str:
    lines = ["# Start-up vs steady-state peak resident memory per rank", "",
             "bench/startup_memory.py: ~270M-parameter model (fp32), 4 CPU ranks, ZeRO-3, one bucket per "
             "layer, SGD. Peak resident set (VmHWM) after building the stages, and over two training steps "
             "after a reset. Bound: steady peak + largest layer unsharded.", ""]
    for label, entry in payload.items():
        lines += [f"## {label}", "", f"commit `{entry['commit']}`, command `{entry['command']}`", "",
                  "| case | rank | baseline MiB | start-up peak MiB | steady peak MiB | "
                  "start-up - steady MiB | largest layer MiB | local params MiB | within bound |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for case, rows in entry["cases"].items():
            for r in rows:
                over = r["startup_peak_mib"] - r["steady_peak_mib"]
                lines.append(f"| {case} | {r['rank']} | {r['baseline_mib']:.0f} | "
                             f"{r['startup_peak_mib']:.0f} | {r['steady_peak_mib']:.0f} | {over:+.0f} | "
                             f"{r['largest_layer_mib']:.0f} | {r['local_param_mib']:.0f} | "
                             f"{'yes' if r['startup_within_bound'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="name of this run's rows (e.g. before, after)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from medley.launch.nodes import free_port

    # A fixed mmap threshold: glibc's grows with every large free (up to 32 MB), after which freed
    # tensors stay in the heap and count as resident; the ranks inherit this at start.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))

    path = args.out / "startup_memory.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    entry = provenance() | {"commit": _medley_commit(), "cases": {}}
    for case in args.cases.split(","):
        port = free_port()
        rows_file = args.out / f".startup_{case}.json"
        mp.start_processes(rank_main, args=(4, port, case, str(rows_file)), nprocs=4, join=True,
                           start_method="spawn")
        entry["cases"][case] = json.loads(rows_file.read_text())
        rows_file.unlink()
        for r in entry["cases"][case]:
            print(f"{args.label} {case} rank {r['rank']}: start-up {r['startup_peak_mib']:.0f} MiB, steady "
                  f"{r['steady_peak_mib']:.0f} MiB, largest layer {r['largest_layer_mib']:.0f} MiB",
                  flush=True)
    payload[args.label] = entry
    path.write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / "startup_memory.md").write_text(markdown(payload))
    print(f"wrote {path} and {args.out / 'startup_memory.md'}")


if __name__ == "__main__":
    main()
