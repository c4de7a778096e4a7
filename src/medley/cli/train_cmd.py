"""``medley train``: run a plan for real (a plan file, or a plan given inline by the flags of
``medley simulate``), one rank per device of the plan.

Launch it with torchrun (``torchrun --nproc-per-node N $(which medley) train ...``; gloo on
CPU, nccl on CUDA) or let it start the ranks itself with ``--local-ranks N``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from medley.cli import hf_cmd
from medley.cli.console import literal, make_console
from medley.cli.errors import MedleyInputError, exit_on_input_error, print_error
from medley.cli.inline_flags import INLINE_DEFAULTS, inline_options
from medley.cli.job_file import load_job_callback, refuse_plan_settings
from medley.cli.train_inputs import check_inputs_exist, finished_line, home
from medley.plan.inline import InlineFlags
from medley.plan.plan import Plan
from medley.runtime.placement import ranks_needed
from medley.spec.limits import MAX_SEED, MAX_STEPS

DEFAULT_DEVICE = "A100-80GB"


def parse_slowdown(text: str | None) -> dict[int, float]:
    """``"0=2,3=1.5"`` as {device id: factor}."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        device, _, factor = item.partition("=")
        try:
            out[int(device)] = float(factor)
        except ValueError:
            raise MedleyInputError(
                f"--slowdown '{text}' must look like '0=2.0,3=1.5' (device id=factor)") from None
    return out


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
    from medley.runtime.launch import InputFailure, rank_main, train_local

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
    from medley.runtime.launch import uses_cuda

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
    from medley.runtime.launch import RankFailure

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


def print_records(plan: Plan, records: list, console: Console, *, split: str | None = None) -> None:
    shapes = " + ".join(f"{g.schedule} pp={g.pp} dp={g.dp}" for g in plan.groups)
    zero = " + ".join(str([z.level for z in g.zero]) for g in plan.groups)
    table = Table(title=f"{plan.shared.model.name} · {shapes} · {split_label(plan, split)} · ZeRO {zero}")
    evaluated = any(r.eval_loss is not None for r in records)
    for col in ("step", "loss", *(["eval loss"] if evaluated else []), "lr", "grad norm", "step time",
                "tokens/s"):
        table.add_column(col, justify="right")
    for r in records:
        shown = [f"{r.eval_loss:.4f}" if r.eval_loss is not None else ""] if evaluated else []
        table.add_row(str(r.step), f"{r.loss:.4f}", *shown, f"{r.lr:.2e}", f"{r.grad_norm:.3f}",
                      f"{r.step_time_s * 1e3:.1f} ms", f"{r.tokens_per_s:,.0f}")
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
    def train_cmd(
        ctx: typer.Context,
        job: Annotated[Path | None, typer.Option("--config", callback=load_job_callback, is_eager=True, help=(
            "Job file (TOML): these flags by section; a flag given here wins (docs/job-file.md)"))] = None,
        plan: Annotated[Path | None, typer.Option(
            callback=home, help="Plan TOML file (else the inline flags)")] = None,
        steps: Annotated[int, typer.Option(min=1, max=MAX_STEPS, help="Optimizer steps in total")] = 20,
        data: Annotated[str | None, typer.Option(callback=home, help=(
            "Data: .jsonl, .parquet (file or directory), datasets save_to_disk directory, .bin token file, "
            "text file, or 'synthetic' (default: shipped corpus)"))] = None,
        tokenizer: Annotated[str | None, typer.Option(callback=home, help=(
            "tokenizer.json (or its directory) for text data (default: the model directory's, else a "
            "text file is read as bytes)"))] = None,
        text_field: Annotated[str, typer.Option(help="JSON field / column holding the text")] = "text",
        data_format: Annotated[str, typer.Option(help=(
            "auto (by the first row's fields), text, chat ('messages' in the chat template, loss on the "
            "assistant's tokens) or completion ('prompt'/'completion', loss on the completion)"))] = "auto",
        chat_template: Annotated[str | None, typer.Option(callback=home, help=(
            "Jinja chat template file for chat data (default: the tokenizer directory's)"))] = None,
        token_dtype: Annotated[str | None, typer.Option(help=(
            ".bin token ids: uint16 or uint32 (default: from the .idx beside it, else uint16)"))] = None,
        data_cache: Annotated[Path | None, typer.Option(callback=home, help=(
            "Token cache directory (default: ~/.cache/medley/tokens)"))] = None,
        val_data: Annotated[str | None, typer.Option(
            callback=home, help="Validation data (same formats as --data)")] = None,
        val_fraction: Annotated[float, typer.Option(help="Hold out this share of --data")] = 0.0,
        eval_every: Annotated[int, typer.Option(help="Validation loss every N steps (0: off)")] = 0,
        eval_batches: Annotated[int, typer.Option(help="Validation batches per evaluation")] = 2,
        tensorboard: Annotated[Path | None, typer.Option(
            callback=home, help="Write TensorBoard scalars here")] = None,
        checkpoint_dir: Annotated[Path | None, typer.Option(
            callback=home, help="Save here; resume from the newest")] = None,
        checkpoint_every: Annotated[int, typer.Option(help="Save every K steps (0: at the end)")] = 0,
        async_checkpoint: Annotated[bool, typer.Option("--async-checkpoint", help=(
            "Write checkpoints in the background while training goes on (DCP async save); each is "
            "published when the next starts, the last one at once"))] = False,
        keep: Annotated[int | None, typer.Option(help=(
            "Newest checkpoints kept, older ones deleted (default 2)"))] = None,
        local_ranks: Annotated[int | None, typer.Option(help="Start N ranks on this machine")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Step records and placement as JSON")] = False,
        emulate: Annotated[bool, typer.Option(help="Stretch compute per the plan's device speeds")] = False,
        device: Annotated[str, typer.Option(help=(
            "auto: compute on the plan's devices (a GPU plan where CUDA has no such GPU is refused); cpu: "
            "run any plan on this CPU (gloo), on purpose"))] = "auto",
        slowdown: Annotated[str | None, typer.Option(help="Emulated slowdown by device: 0=2,3=1.5")] = None,
        slowdown_from: Annotated[int, typer.Option(min=0, help=(
            "The --slowdown factors apply from this step on (a device that slows down mid-run)"))] = 0,
        elastic: Annotated[bool, typer.Option("--elastic", help=(
            "A rank of an elastic run: re-plan for the devices present (medley launch --elastic sets "
            "it)"))] = False,
        straggler_margin: Annotated[float, typer.Option(help=(
            "Elastic: a device computing this share slower than planned, relative to the median device, "
            "is a straggler"))] = 0.5,
        straggler_steps: Annotated[int, typer.Option(min=0, help=(
            "Elastic: ... for this many steps in a row: re-planned at its measured speed at the next "
            "checkpoint (0: off)"))] = 3,
        seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of weights and data order")] = 0,
        optimizer: Annotated[str, typer.Option(help="adamw or sgd")] = "adamw",
        lr: Annotated[float, typer.Option(help="Peak learning rate (0: no updates)")] = 3e-3,
        min_lr: Annotated[float, typer.Option(help="Learning rate at the end of the cosine decay")] = 3e-4,
        warmup_steps: Annotated[int, typer.Option(min=0, max=MAX_STEPS, help="Linear warm-up steps")] = 5,
        weight_decay: Annotated[float, typer.Option(help="Weight decay")] = 0.1,
        clip_norm: Annotated[float, typer.Option(help="Global gradient-norm clip (0: off)")] = 1.0,
        dtype: Annotated[str | None, typer.Option(
            help="fp32, bf16 or fp16 (default: the plan's on CUDA, fp32 on CPU)")] = None,
        log_jsonl: Annotated[Path | None, typer.Option(
            callback=home, help="Append one JSON line per step here")] = None,
        step_timeout: Annotated[float, typer.Option(help="Seconds until a stuck step fails (0: off)")] = 600,
        first_step_timeout: Annotated[float, typer.Option(help=(
            "Seconds until a stuck first step (compiling, allocating) fails (0: off)"))] = 1800,
        checkpoint_timeout: Annotated[float, typer.Option(help=(
            "Seconds until a stuck checkpoint save fails (0: off)"))] = 1800,
        log_every: Annotated[int, typer.Option(help=(
            "Gather the statistics and log a line every N steps (no host sync on the steps between)"))] = 10,
        gc_every: Annotated[int, typer.Option(help=(
            "Python garbage collection between steps every N steps, off inside steps (0: automatic)"))] = 50,
        cluster: Annotated[str | None, typer.Option(
            callback=home, help=(
            "Inline plan: Cluster TOML file or NxA100-80GB (default: one node of dp x sum(tp) "
            "A100-80GB)"))] = None,
        model: Annotated[str | None, typer.Option(callback=home,
            help="Inline plan: Model preset, config.json or Hugging Face model directory (default: tiny, "
                 "or the --init-from directory)")] = None,
        inline: InlineFlags = INLINE_DEFAULTS,  # the inline plan's flags (inline_options)
        reset_data_order: Annotated[bool, typer.Option(
            help="Resume although the seed, global batch or --data differ from the checkpoint's")] = False,
        init_from: Annotated[Path | None, typer.Option(callback=home,
            help="Start from this Hugging Face model directory's safetensors weights")] = None,
        export_hf: Annotated[Path | None, typer.Option(callback=home,
            help="After training, write the model here as a Hugging Face model directory")] = None,
        compile_blocks: Annotated[bool, typer.Option("--compile", help=(
            "torch.compile each transformer block (the first step includes compiling)"))] = False,
    ) -> None:
        """Train a plan on torch.distributed and report loss, step time and memory per step."""
        if plan is not None:
            refuse_plan_settings(ctx, plan=plan)
        check_inputs_exist({"--data": data, "--val-data": val_data, "--tokenizer": tokenizer,  # before torch
                            "--chat-template": chat_template, "--init-from": init_from, "--plan": plan})
        done = None if export_hf is not None else finished_line(checkpoint_dir, steps)  # export still due
        if done is not None:
            typer.echo(literal(done), err=True)
            return
        from medley.plan.plan import load_plan
        from medley.runtime.train import TrainConfig, check_config

        config = TrainConfig.of(
            steps=steps, seed=seed, optimizer=optimizer, lr=lr, warmup_steps=warmup_steps, min_lr=min_lr,
            weight_decay=weight_decay, clip_norm=clip_norm or None, data=data, tokenizer=tokenizer,
            text_field=text_field, data_format=data_format, chat_template=chat_template,
            token_dtype=token_dtype, data_cache=data_cache, val_data=val_data,
            val_fraction=val_fraction, eval_every=eval_every, eval_batches=eval_batches,
            tensorboard=tensorboard, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, log_jsonl=log_jsonl, emulate=emulate,
            slowdown=parse_slowdown(slowdown), slowdown_from=slowdown_from, device=device, elastic=elastic,
            straggler_margin=straggler_margin, straggler_steps=straggler_steps, progress=not as_json,
            dtype=dtype,
            step_timeout_s=step_timeout or None, first_step_timeout_s=first_step_timeout or None,
            checkpoint_timeout_s=checkpoint_timeout or None, log_every=log_every, gc_every=gc_every,
            reset_data_order=reset_data_order,
            init_from=init_from, hf_dir=hf_cmd.hf_dir_of(model, init_from), compile=compile_blocks)
        if keep is not None:
            config.checkpoint.keep = keep
        config.checkpoint.async_save = async_checkpoint
        if compile_blocks:
            from medley.runtime.compile import check_compile_available

            check_compile_available()
        if export_hf is not None:
            hf_cmd.check_export_target(export_hf, flag="--export-hf")
            if checkpoint_dir is None:
                config.checkpoint.dir = hf_cmd.export_checkpoints(export_hf)
        check_config(config)  # output paths and numbers, before any work
        if plan is not None:
            the_plan = load_plan(plan)
        else:  # an inline plan is made in the precision the run computes in: no precision note
            the_plan = inline_plan(
                inline, cluster=cluster, model=model or (str(init_from) if init_from else "tiny"),
                clip_grad=bool(clip_norm), dtype=inline_dtype(dtype, local_ranks=local_ranks, device=device))
        if local_ranks is not None and local_ranks != the_plan.world_size:
            raise MedleyInputError(
                f"--local-ranks {local_ranks}: the plan needs {ranks_needed(the_plan)}; "
                f"pass --local-ranks {the_plan.world_size}")
        if plan is not None or cluster is not None:  # the default inline cluster names no GPU on purpose
            device_line(the_plan, config, local_ranks=local_ranks)
        from medley.runtime.config import load_data

        # A bad --data fails once, before launch; a text data set is tokenized here, once.
        shared = the_plan.shared
        source = load_data(config, seq_len=shared.seq_len, vocab_size=shared.model.vocab_size)
        for note in source.notes:
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
            hf_cmd.export_after_training(config.checkpoint.dir, export_hf, temporary=checkpoint_dir is None)
            typer.echo(f"wrote the Hugging Face model {literal(str(export_hf))}", err=True)
        if as_json:
            data = run_json(records)
            if config.elastic.elastic:  # what happened on the way, every attempt's (its records are its last)
                from medley.runtime.elastic_dir import SUBDIR, events

                data["events"] = events(Path(str(config.checkpoint.dir)) / SUBDIR)
            typer.echo(json.dumps(data, indent=1, allow_nan=False))
        else:
            print_records(the_plan, records, make_console(), split=inline.split if plan is None else None)
