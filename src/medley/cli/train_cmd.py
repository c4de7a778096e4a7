"""``medley train``: run a plan for real (a plan file, or a plan given inline by the flags of
``medley simulate``), one rank per device of the plan.

Launch it with torchrun (``torchrun --nproc-per-node N $(which medley) train ...``; gloo on
CPU, nccl on CUDA) or let it start the ranks itself with ``--local-ranks N``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from medley.cli import hf_cmd
from medley.cli.console import literal, make_console
from medley.cli.error_exit import MedleyInputError, exit_on_input_error, print_error
from medley.cli.job_file import load_job_callback, refuse_plan_settings
from medley.cli.options import inline_options, settings_options
from medley.cli.train_inputs import check_inputs_exist, finished_line, home
from medley.plan.inline import InlineFlags
from medley.plan.plan import Plan
from medley.runtime.placement import ranks_needed
from medley.runtime.settings import TrainConfig

DEFAULT_DEVICE = "A100-80GB"


def inline_plan(flags: InlineFlags, *, cluster: str | None, model: str, clip_grad: bool,
                dtype: str | None = None) -> Plan:
    """The plan ``medley train`` runs without ``--plan``; ``dtype`` None lets the devices choose
    (bf16 where all have it, else fp16). Without ``cluster``, one node of dp x sum(tp) default
    devices (so every TP group shares it)."""
    from medley.cost.estimator import CatalogCostSource
    from medley.plan.inline import devices_needed, layout_of, parse_tp
    from medley.spec.cluster_load import parse_cluster_arg
    from medley.spec.model_arg import get_model

    if cluster is None:
        need = devices_needed(pp=flags.pp, dp=flags.dp, tp=parse_tp(flags.tp, pp=flags.pp))
        cluster = f"{need}x{DEFAULT_DEVICE}"
    spec = parse_cluster_arg(cluster)
    model_spec = get_model(model)
    layout = layout_of(flags, cluster=spec, model=model_spec, dtype=dtype, clip_grad=clip_grad,
                       cost=CatalogCostSource.for_cluster(model_spec, spec))
    return Plan(layout=layout, cluster=spec)


def run(plan: Plan, config, *, local_ranks: int | None,  # noqa: ANN001, ANN201 - lazy torch import
        plan_path: Path | None = None):
    """Records on the rank that reports (rank 0), None on the others."""
    from medley.launch.spawn import InputFailure, rank_main, train_local

    if local_ranks is not None:
        return train_local(plan, config, nprocs=local_ranks)
    if config.elastic.elastic:
        if "RANK" not in os.environ or plan_path is None:
            raise MedleyInputError("--elastic: the ranks of an elastic run are started by torchrun's elastic "
                                   "agents with a plan file: use medley launch PLAN --elastic")
        from medley.elastic.rank import run_rank

        def check(new: Plan) -> None:
            check_fits(new, config, local_ranks=None)

        result = rank_main(plan, config, body=functools.partial(run_rank, plan_path=plan_path, check=check))
    elif "RANK" not in os.environ:
        raise MedleyInputError(
            f"the plan needs {ranks_needed(plan)}: launch with torchrun --nproc-per-node "
            f"{plan.world_size} or pass --local-ranks {plan.world_size}")
    else:
        result = rank_main(plan, config)
    if isinstance(result, InputFailure):
        if int(os.environ["RANK"]) == 0:
            raise MedleyInputError(result.message)
        raise typer.Exit(code=2)
    return result


def split_label(plan: Plan, split: str | None) -> str:
    """The split as the user gave it, labelled: ``--split 2,2`` is blocks per stage (the plan's
    stage_layers count the embedding and the head too)."""
    layers = " + ".join(",".join(str(n) for n in group.stage_layers) for group in plan.groups)
    if split is None:
        return f"split {layers} (layers per stage)"
    given = [int(v) for v in split.split(",")]
    unit = "layers" if sum(given) == plan.shared.model.num_layers else "blocks"
    return f"split {','.join(map(str, given))} ({unit} per stage)"


def adapter_lines(plan: Plan) -> list[str]:
    """What a LoRA plan trains, once before the ranks start."""
    from medley.cost import formulas

    lora, model = plan.shared.adapter, plan.shared.model
    if lora is None:
        return []
    trained = lora.block_params(model) * model.num_blocks
    share = trained / (formulas.total_params(model) + trained)
    return [f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.targets)}: {trained:,} "
            f"trainable parameters ({share:.2%} of the model); the base is frozen"]


def step_time_line(records: list) -> str:
    """The mean step time, saying which steps it covers (the first one includes warm-up)."""
    if len(records) == 1:
        return f"step time {records[0].step_time_s * 1e3:.1f} ms (a single step, warm-up included)"
    steady = records[1:]
    mean = sum(r.step_time_s for r in steady) / len(steady)
    return f"mean step {mean * 1e3:.1f} ms over {len(steady)} steps (the first step excluded)"


def inline_dtype(dtype: str | None, *, local_ranks: int | None, device: str = "auto") -> str | None:
    """``--dtype`` when given, else fp32 on CPU (what the run computes in there) and, on CUDA, None
    for the devices' choice."""
    if dtype is not None:
        return dtype
    return None if runs_on_cuda(local_ranks, device=device) else "fp32"


def runs_on_cuda(local_ranks: int | None, *, device: str) -> bool:
    """Whether this node's ranks compute on CUDA: a GPU per rank, and not ``--device cpu``."""
    from medley.launch.spawn import uses_cuda

    return device != "cpu" and uses_cuda(local_world_size(local_ranks))


def local_world_size(local_ranks: int | None) -> int:
    """The ranks of this node: ``--local-ranks``, or torchrun's LOCAL_WORLD_SIZE."""
    return local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_fits(plan: Plan, config, *, local_ranks: int | None) -> None:  # noqa: ANN001 - lazy import
    """Refuse, before any rank starts, a plan the runtime cannot run or this machine cannot hold
    (:func:`medley.cli.preflight.preflight`: ``--local-ranks`` ranks here, or under torchrun the
    LOCAL_WORLD_SIZE ranks of this node), and say once when the run computes in another precision
    than the plan's (:func:`medley.cli.preflight.precision_note`)."""
    from medley.cli.preflight import precision_note, preflight
    from medley.runtime.train import run_dtype

    local_world = local_world_size(local_ranks)
    on_cuda = runs_on_cuda(local_ranks, device=config.emulation.device)
    dtype = run_dtype(plan, config, on_cuda=on_cuda)
    preflight(plan, dtype=dtype, local_ranks=local_world, on_cuda=on_cuda)
    if int(os.environ.get("RANK", "0")) == 0:
        note = precision_note(plan, dtype, chosen=config.precision.dtype is not None)
        if note is not None:
            typer.echo(note, err=True)


def device_line(plan: Plan, config, *, local_ranks: int | None) -> None:  # noqa: ANN001 - lazy import
    """The device check (:func:`medley.cli.preflight.check_devices`) before anything else is said or
    started: a GPU plan without its GPUs is one line and exit 2 (under torchrun from local rank 0
    only, the node's other ranks exit 2 quietly); one run on the CPU on purpose says so first."""
    from medley.cli.preflight import check_devices

    emulation = config.emulation
    try:
        note = check_devices(plan, device=emulation.device, local_ranks=local_ranks,
                             emulate=emulation.emulate or bool(emulation.slowdown))
    except MedleyInputError:
        if local_ranks is None and os.environ.get("LOCAL_RANK", "0") != "0":
            raise typer.Exit(code=2) from None
        raise
    if note is not None and int(os.environ.get("RANK", "0")) == 0:
        typer.echo(note, err=True)


def run_stopping_cleanly(plan: Plan, config, *, local_ranks: int | None,  # noqa: ANN001, ANN201
                         plan_path: Path | None = None):
    """:func:`run`, with a failed rank (exit 1) and an interrupt (exit 130 for SIGINT, 128 + the
    signal otherwise) as one line, the ranks stopped; tracebacks only with ``--debug``."""
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException

    from medley.errors import debug_enabled
    from medley.launch.spawn import RankFailure

    try:
        return run(plan, config, local_ranks=local_ranks, plan_path=plan_path)
    except RankFailure as err:
        print_error(str(err))
        raise typer.Exit(code=1) from None
    except (KeyboardInterrupt, SignalException) as err:
        if debug_enabled():
            raise
        sig = err.sigval if isinstance(err, SignalException) else signal.SIGINT
        typer.echo(f"interrupted ({signal.Signals(sig).name}): the ranks were stopped; run again to resume "
                   "from the newest checkpoint", err=True)
        raise typer.Exit(code=128 + int(sig)) from None


def run_json(records) -> dict[str, list[dict]]:  # noqa: ANN001 - a launch.TrainRun (lazy torch import)
    """``{"records": [step records], "placement": [{"rank", "node", "device", "replica",
    "pipeline_rank", "stages", "tp_rank"}, ...]}``: the placement as the ranks measured it, by
    global rank."""
    rows = [r.as_json() for r in records]
    return {"records": rows, "placement": [entry.as_json() for entry in getattr(records, "placement", [])]}


TABLE_ROWS = 20  # at most about this many steps in the table after a run


def print_records(plan: Plan, records: list, console: Console, *, split: str | None = None) -> None:
    """The run's summary: a table of its steps (counted as steps done, like the progress lines
    and the checkpoints; a long run's every k-th), the step time against the prediction, peak
    memory."""
    shapes = " + ".join(f"{g.schedule} pp={g.pp} dp={g.dp}" for g in plan.groups)
    zero = " + ".join(str([z.level for z in g.zero]) for g in plan.groups)
    table = Table(title=f"{plan.shared.model.name} · {shapes} · {split_label(plan, split)} · ZeRO {zero}")
    evaluated = any(r.eval_loss is not None for r in records)
    for col in ("step", "loss", *(["eval loss"] if evaluated else []), "lr", "grad norm", "step time",
                "tokens/s"):
        table.add_column(col, justify="right")
    every = math.ceil(len(records) / TABLE_ROWS) if records else 1
    for index, r in enumerate(records):
        if index % every and index != len(records) - 1 and r.eval_loss is None:
            continue
        shown = [f"{r.eval_loss:.4f}" if r.eval_loss is not None else ""] if evaluated else []
        table.add_row(str(r.step + 1), f"{r.loss:.4f}", *shown, f"{r.lr:.2e}", f"{r.grad_norm:.3f}",
                      f"{r.step_time_s * 1e3:.1f} ms", f"{r.tokens_per_s:,.0f}")
    if every > 1:
        table.caption = (f"one step in {every} of {len(records)} (and the evaluated ones); every step: "
                         "--json or --log-jsonl")
    console.print(table)
    if not records:
        console.print("nothing to run: the checkpoint is already at --steps")
        return
    line = step_time_line(records)
    if plan.prediction is not None:
        line += f" · predicted {plan.prediction.step_time_s * 1e3:.1f} ms"
    console.print(line)
    if records[-1].peak_memory_bytes:
        peaks = sorted(records[-1].peak_memory_bytes.items())
        memory = ", ".join(f"{d}: {b / 2**20:.1f} MiB" for d, b in peaks)
        console.print(f"peak memory per device: {memory}")


def register(app: typer.Typer) -> None:
    @app.command("train")
    @exit_on_input_error
    @inline_options(prefix="Inline plan: ")
    @settings_options()
    def train_cmd(
        ctx: typer.Context,
        job: Annotated[Path | None, typer.Option("--config", callback=load_job_callback, is_eager=True, help=(
            "Job file (TOML): these flags by section; a flag given here wins (docs/job-file.md)"))] = None,
        plan: Annotated[Path | None, typer.Option(
            callback=home, help="Plan TOML file (else the inline flags)")] = None,
        local_ranks: Annotated[int | None, typer.Option(help="Start N ranks on this machine")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Step records and placement as JSON")] = False,
        cluster: Annotated[str | None, typer.Option(
            callback=home, help=(
            "Inline plan: Cluster TOML file or NxA100-80GB (default: one node of dp x sum(tp) "
            "A100-80GB)"))] = None,
        model: Annotated[str | None, typer.Option(callback=home,
            help="Inline plan: Model preset, config.json or Hugging Face model directory (default: tiny, "
                 "or the --init-from directory)")] = None,
        export_hf: Annotated[Path | None, typer.Option(callback=home,
            help="After training, write the model here as a Hugging Face model directory")] = None,
        export_dtype: Annotated[str, typer.Option(
            help="--export-hf weights' dtype: fp32, bf16 or fp16")] = "fp32",
        *,
        inline: InlineFlags,  # the inline plan's flags (inline_options)
        config: TrainConfig,  # the run's settings (settings_options)
    ) -> None:
        """Train a plan on torch.distributed and report loss, step time and memory per step."""
        if plan is not None:
            refuse_plan_settings(ctx, plan=plan)
        data, ckpt = config.data, config.checkpoint
        ckpt_given = ckpt.dir
        init_from = config.model.init_from
        check_inputs_exist({"--data": data.path, "--val-data": data.val_data, "--tokenizer": data.tokenizer,
                            "--chat-template": data.chat_template, "--init-from": init_from, "--plan": plan})
        steps = config.optimizer.steps
        # (an export is still due; --epochs sets the steps from the data)
        done = None if export_hf is not None or config.optimizer.epochs is not None \
            else finished_line(ckpt.dir, steps)
        if done is not None:  # (before torch is imported)
            typer.echo(literal(done), err=True)
            return
        from medley.plan.plan import load_plan
        from medley.runtime.train import check_config

        config.logging.progress = not as_json
        config.model.hf_dir = hf_cmd.hf_dir_of(model, init_from)
        if config.model.compile:
            from medley.runtime.torch_compile import check_compile_available

            check_compile_available()
        if export_hf is not None:
            hf_cmd.check_export_target(export_hf, flag="--export-hf")
            from medley.runtime.hf_export import check_export_dtype

            check_export_dtype(export_dtype, flag="--export-dtype")
            if ckpt.dir is None:
                ckpt.dir = hf_cmd.export_checkpoints(export_hf)
        check_config(config)  # output paths and numbers, before any work
        device = config.emulation.device
        if plan is not None:
            the_plan = load_plan(plan)
        else:  # an inline plan is made in the precision the run computes in: no precision note
            the_plan = inline_plan(
                inline, cluster=cluster, model=model or (str(init_from) if init_from else "tiny"),
                clip_grad=config.optimizer.clip_norm is not None,
                dtype=inline_dtype(config.precision.dtype, local_ranks=local_ranks, device=device))
        if local_ranks is not None and local_ranks != the_plan.world_size:
            raise MedleyInputError(
                f"--local-ranks {local_ranks}: the plan needs {ranks_needed(the_plan)}; "
                f"pass --local-ranks {the_plan.world_size}")
        if plan is not None or cluster is not None:  # the default inline cluster names no GPU on purpose
            device_line(the_plan, config, local_ranks=local_ranks)
        from medley.runtime.config import load_data, with_epochs

        # A bad --data fails once, before launch; a text data set is tokenized here, once.
        shared = the_plan.shared
        source = load_data(config, seq_len=shared.seq_len, vocab_size=shared.model.vocab_size)
        config, epochs = with_epochs(config, source, sequences=the_plan.sequences_per_step)
        for note in (*source.notes, *([epochs] if epochs else []), *adapter_lines(the_plan)):
            typer.echo(literal(note), err=True)
        if init_from is not None:
            hf_cmd.check_init_from(the_plan.shared.model, init_from)
        check_fits(the_plan, config, local_ranks=local_ranks)
        records = run_stopping_cleanly(the_plan, config, local_ranks=local_ranks, plan_path=plan)
        if records is None:
            return
        if records.plan is not None:  # an elastic run: the plan it ended under
            the_plan = records.plan
        if export_hf is not None:
            hf_cmd.export_after_training(ckpt.dir, export_hf, temporary=ckpt_given is None,
                                         dtype=export_dtype)
            typer.echo(f"wrote the Hugging Face model {literal(str(export_hf))}", err=True)
        if as_json:
            out = run_json(records)
            if config.elastic.elastic:  # what happened on the way, every attempt's (its records are its last)
                from medley.launch.elastic_dir import SUBDIR, events

                out["events"] = events(Path(str(ckpt.dir)) / SUBDIR)
            typer.echo(json.dumps(out, indent=1, allow_nan=False))
        else:
            print_records(the_plan, records, make_console(), split=inline.split if plan is None else None)
