"""``medley profile``: measure a model's layers and the backend's collectives into a profile file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from medley.cli.console import make_console, print_table, progress_steps
from medley.cost.profile_format import Profile, save_profile
from medley.errors import MedleyInputError
from medley.fileio import check_output_dir, check_output_file
from medley.plan.inline import parse_int_list
from medley.spec.model_arg import get_model


def _ints(text: str, flag: str) -> tuple[int, ...]:
    count = len(str(text).split(","))
    values = parse_int_list(text, flag=flag, count=count, minimum=1)
    assert values is not None
    return values


def print_profile(profile: Profile, console: Console) -> None:
    compiled = ", blocks compiled" if profile.compiled else ""
    table = Table(title=f"{profile.model.get('name')} on {profile.device_type} ({profile.device_detail}), "
                        f"{profile.dtype}{compiled}, {profile.threads} thread(s), "
                        f"torch {profile.torch_version}")
    columns = ("layer", "mbs", "seq", "F ms", "B ms", "W ms", "fused B+W ms", "activations MB", "after B MB")
    for col in columns:
        table.add_column(col, justify="right")
    for m in profile.layers:
        table.add_row(m.kind, str(m.micro_batch_size), str(m.seq_len), f"{m.forward_s * 1e3:.3f}",
                      f"{m.backward_input_s * 1e3:.3f}", f"{m.backward_weight_s * 1e3:.3f}",
                      f"{m.backward_full_s * 1e3:.3f}", f"{m.activation_bytes / 1e6:.2f}",
                      f"{m.activation_after_b_bytes / 1e6:.2f}")
    print_table(console, table)
    if profile.comm is not None:
        fits = Table(title=f"α-β fits over {profile.comm.backend}")
        for col in ("op / group size", "α µs", "β GB/s", "median error"):
            fits.add_column(col, justify="right")
        by_ranks = [(f"{k} ranks", v) for k, v in profile.comm.link_by_ranks.items()]
        rows = [*profile.comm.fits.items(), *by_ranks, ("all (link)", profile.comm.link)]
        for name, fit in rows:
            fits.add_row(name, f"{fit.latency_s * 1e6:.1f}", f"{fit.bandwidth_bytes_per_s / 1e9:.2f}",
                         f"{fit.median_rel_error:.0%}")
        print_table(console, fits)


def _comm_profile(out: Path, *, sizes: tuple[int, ...] | None, runs: int, as_json: bool) -> None:
    from medley.cost.comm_profile import save_comm_profile
    from medley.profile.comm_tiers import measure_tiers

    profile = measure_tiers(runs=runs, **({} if sizes is None else {"sizes": sizes}))
    if profile is None:  # not rank 0
        return
    save_comm_profile(profile, out)
    if as_json:
        typer.echo(json.dumps(profile.model_dump(mode="json"), indent=1))
        return
    table = Table(title=f"α-β per network tier over {profile.backend} ({profile.world_size} ranks)")
    for col in ("tier", "nodes", "ranks", "α µs", "β GB/s", "median error"):
        table.add_column(col, justify="right")
    for link in profile.links:
        table.add_row(link.tier, ", ".join(link.nodes), str(link.ranks), f"{link.fit.latency_s * 1e6:.1f}",
                      f"{link.fit.bandwidth_bytes_per_s / 1e9:.2f}", f"{link.fit.median_rel_error:.0%}")
    console = make_console()
    print_table(console, table)
    console.print(f"wrote {out} (`medley plan ... --comm-profile {out}` uses it)")


def register(app: typer.Typer) -> None:
    @app.command("profile")
    def profile_cmd(
        model: Annotated[
            str | None, typer.Option(help="Preset name or a Hugging Face config.json (not with --comm)")
        ] = None,
        device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
        device_type: Annotated[
            str | None,
            typer.Option(help="Catalog device type to label the profile with (default: the GPU's entry, "
                         "CPU-8GB on a CPU)"),
        ] = None,
        micro_batch_sizes: Annotated[
            str, typer.Option(help="Micro-batch sizes to measure, e.g. 1,2,4")
        ] = "1,2,4",
        seq_len: Annotated[str, typer.Option(help="Sequence lengths to measure, e.g. 128,512")] = "128",
        dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16")] = "fp32",
        threads: Annotated[int, typer.Option(min=1, help="torch threads (CPU ranks run one each)")] = 1,
        runs: Annotated[int, typer.Option(min=1, help="Timed repetitions per figure (median kept)")] = 5,
        comm_ranks: Annotated[
            str, typer.Option(help="Group sizes for the gloo collective benchmarks; 0 skips them")
        ] = "2,4",
        comm: Annotated[
            bool, typer.Option("--comm", help="Under torchrun: measure the links per network tier (no model)")
        ] = False,
        comm_sizes: Annotated[
            str | None, typer.Option(help="Message bytes for --comm, e.g. 4096,1048576")
        ] = None,
        overhead: Annotated[
            bool, typer.Option(help="Also measure the runtime's cost per action and per transfer (CPU)")
        ] = True,
        out: Annotated[Path, typer.Option(help="Profile file to write (JSON)")] = Path("profile.json"),
        as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON")] = False,
        compiled: Annotated[bool, typer.Option(
            "--compile", help="Time blocks torch.compiled, as `medley train --compile` runs them")] = False,
    ) -> None:
        """Measure F, B, W times and activation bytes per layer kind (and collectives) into a profile;
        with --comm, under torchrun, the α-β figures of each network tier (`--comm-profile` of plan)."""
        check_output_file(out, flag="--out")
        if comm:
            _comm_profile(out, sizes=None if comm_sizes is None else _ints(comm_sizes, "--comm-sizes"),
                          runs=runs, as_json=as_json)
            return
        if model is None:
            raise MedleyInputError("medley profile: give --model (or --comm, under torchrun, for the links)")
        from medley.profile.run import profile_steps, run_profile

        ranks = () if comm_ranks.strip() == "0" else _ints(comm_ranks, "--comm-ranks")
        if compiled:
            from medley.runtime.torch_compile import check_compile_available

            check_compile_available()
        spec = get_model(model)
        sizes, lens = _ints(micro_batch_sizes, "--micro-batch-sizes"), _ints(seq_len, "--seq-len")
        overhead = overhead and device == "cpu"
        with progress_steps(profile_steps(ranks, overhead=overhead), enabled=not as_json) as step:
            profile = run_profile(spec, device=device, device_type=device_type, micro_batch_sizes=sizes,
                                  seq_lens=lens, dtype=dtype, threads=max(1, threads), runs=max(1, runs),
                                  comm_ranks=ranks, progress=step, overhead=overhead, compiled=compiled)
        save_profile(profile, out)
        if as_json:
            typer.echo(json.dumps(profile.model_dump(mode="json"), indent=1))
        else:
            console = make_console()
            print_profile(profile, console)
            console.print(f"wrote {out}")

    @app.command("fidelity")
    def fidelity_cmd(
        out: Annotated[Path, typer.Option(help="Directory for the profiles and the report")] = Path(
            "out/fidelity"
        ),
        quick: Annotated[
            bool, typer.Option(help="Two plans only (clipped pp2 1F1B, dp2 ZeRO-1 in 4 buckets)")
        ] = False,
        cases: Annotated[str, typer.Option(help="Comma-separated case names (default: all)")] = "",
        steps: Annotated[
            int, typer.Option(help="Training steps per plan (the first min(5, steps/2) untimed)")
        ] = 20,
        reuse_profiles: Annotated[
            bool,
            typer.Option(help="Reuse profile-cpu-*.json in --out as they are (no profiling at all)"),
        ] = False,
    ) -> None:
        """How right the simulator is here: predicted against measured step time and memory.

        Profiles, simulates and trains plans on this machine's CPU and writes JSON + Markdown to
        --out (bench/fidelity.py runs the same)."""
        check_output_dir(out, flag="--out")
        from medley.fidelity.harness import default_cases, harness_steps, quick_cases, run_harness

        chosen = quick_cases() if quick else default_cases()
        if cases:
            wanted = set(cases.split(","))
            unknown = sorted(wanted - {c.name for c in chosen})
            if unknown:
                raise MedleyInputError(f"--cases: unknown {unknown}; choose from "
                                       f"{', '.join(c.name for c in default_cases())}")
            chosen = [c for c in chosen if c.name in wanted]
        if steps < 2:
            raise MedleyInputError(f"--steps {steps}: run at least 2 steps (the first ones are untimed)")
        with progress_steps(harness_steps(chosen, reuse_profiles=reuse_profiles)) as step:
            results = run_harness(chosen, out, name="fidelity", steps=steps, reuse_profiles=reuse_profiles,
                                  meta={"command": " ".join(["medley", *sys.argv[1:]])},
                                  progress=step)
        table = Table(title=f"fidelity on this machine ({out / 'fidelity.md'})")
        for col in ("case", "predicted ms", "fastest ms", "error", "median ms", "replay error",
                    "worst memory error"):
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(r.case, f"{r.predicted_step_s * 1e3:.1f}", f"{r.fastest_step_s * 1e3:.1f}",
                          f"{r.fastest_step_error:+.1%}", f"{r.measured_step_s * 1e3:.1f}",
                          f"{r.replay_error:+.1%}", f"{r.worst_memory_error:+.1%}")
        print_table(make_console(), table)
