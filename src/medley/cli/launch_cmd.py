"""``medley launch PLAN``: what to run on each node the plan uses, an sbatch script for the same,
or (``--local``) every node's torchrun agent started on this machine.

Everything (the plan, the training flags after ``--``, the rendezvous, the output file) is checked
before anything is written or started. The commands come from :mod:`medley.runtime.nodes`; the local
agents run under :func:`medley.runtime.agents.run_agents`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Annotated

import typer

from medley.cli.errors import MedleyInputError, exit_on_input_error, usage_line
from medley.plan.plan import Plan
from medley.runtime.nodes import (
    ONE_THREAD_ENV,
    VISIBLE_ENV,
    LaunchSettings,
    NodeLaunch,
    check_rdzv_id,
    launches_json,
    node_launches,
    shell_quote,
    slurm_script,
)
from medley.runtime.placement import world_size_terms
from medley.spec.cluster_schema import printable

LOCAL_ENV = {VISIBLE_ENV: "", ONE_THREAD_ENV: "1"}  # gloo on CPU, a core per rank
_OWN_FLAGS = {"plan": "--plan", "local_ranks": "--local-ranks"}


def check_train_args(ctx: typer.Context, args: list[str]) -> None:
    """Parse the flags after ``--`` as ``medley train`` would (nothing runs): an unknown flag or a
    bad value, ``--plan`` or ``--local-ranks`` is an input error naming it."""
    root = ctx.find_root()
    train = root.command.get_command(root, "train")  # type: ignore[attr-defined]
    try:
        params = train.make_context("medley train", list(args)).params
    except typer.TyperException as err:
        line = usage_line(err) or str(err)
        raise MedleyInputError(f"the training flags after --: {line}") from None
    for name, flag in _OWN_FLAGS.items():
        if params.get(name) is not None:
            raise MedleyInputError(f"the training flags after --: {flag} is set by medley launch "
                                   "(one rank per plan device, on its node); remove it")


def default_rdzv_id(plan_path: Path) -> str:
    """The same on every node for the same plan file: ``medley-`` and a hash of its contents."""
    return "medley-" + hashlib.sha256(plan_path.read_bytes()).hexdigest()[:10]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_settings(plan_path: Path, train_args: list[str]) -> LaunchSettings:
    """Every agent on this machine: this Python's torchrun and medley, 127.0.0.1 and a free port;
    the agents and their ranks die with this process (:mod:`medley.runtime.local_agent`)."""
    script = Path(sys.executable).with_name("medley")
    program = ("--no-python", str(script)) if script.exists() else ("-m", "medley.cli.main")
    env = dict(LOCAL_ENV)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun would set, without its banner on stdout
    return LaunchSettings(plan_path=str(plan_path.resolve()), train_args=tuple(train_args),
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"medley-{uuid.uuid4().hex[:10]}",
                          launcher=(sys.executable, "-m", "medley.runtime.local_agent"), program=program,
                          extra_env=env)


def describe(plan_path: Path, plan: Plan, launches: list[NodeLaunch]) -> str:
    """The commands for people: a header, then per node its host, devices and command line."""
    endpoint = launches[0].argv[launches[0].argv.index("--rdzv-endpoint") + 1]
    lines = [f"{printable(plan_path)}: {len(launches)} nodes, {plan.world_size} ranks "
             f"({world_size_terms(plan)}); rendezvous {endpoint} (c10d). Run on each node, with the plan "
             "file at that path there:"]
    for launch in launches:
        host, devices = printable(launch.host or "host not given"), ",".join(map(str, launch.devices))
        lines += ["", f"# node {printable(launch.node)} ({host}): devices {devices}", launch.command]
    return "\n".join(lines)


def check_flags(*, local: bool, slurm: Path | None, as_json: bool, dry_run: bool,
                rdzv_id: str | None) -> None:
    if local and slurm is not None:
        raise MedleyInputError("--local and --slurm: choose one (--local runs here, --slurm writes a job)")
    if local and as_json and not dry_run:
        raise MedleyInputError("--json lists the commands with --dry-run; for the training records as JSON "
                               "put --json after --")
    if rdzv_id is not None:
        check_rdzv_id(rdzv_id)


def register(app: typer.Typer) -> None:
    @app.command("launch")
    @exit_on_input_error
    def launch_cmd(
        ctx: typer.Context,
        plan: Annotated[Path, typer.Argument(help="Plan TOML file (medley plan --out)", show_default=False)],
        train_args: Annotated[list[str] | None, typer.Argument(
            help="Training flags for `medley train`, after --", show_default=False)] = None,
        rdzv_endpoint: Annotated[str | None, typer.Option(
            help="HOST[:PORT] of the rendezvous (default: the first node's host, port 29500)")] = None,
        rdzv_id: Annotated[str | None, typer.Option(help="Rendezvous id (default: from the plan)")] = None,
        slurm: Annotated[Path | None, typer.Option(help="Write an sbatch script for the same here")] = None,
        local: Annotated[bool, typer.Option(help="Start every node's agent here (CPU, gloo)")] = False,
        dry_run: Annotated[bool, typer.Option(help="Print the commands, start nothing")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the commands as JSON")] = False,
    ) -> None:
        """Run a plan on its nodes: one torchrun agent per node the plan uses (its devices only)."""
        from medley.fileio import check_output_file, write_atomically
        from medley.plan.plan import load_plan

        check_flags(local=local, slurm=slurm, as_json=as_json, dry_run=dry_run, rdzv_id=rdzv_id)
        if slurm is not None:
            check_output_file(slurm, flag="--slurm")
        the_plan = load_plan(plan)
        args = list(train_args or [])
        check_train_args(ctx, args)
        if local:
            settings = local_settings(plan, args)
        else:
            settings = LaunchSettings(plan_path=str(plan), train_args=tuple(args),
                                      rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id or default_rdzv_id(plan))
        launches = node_launches(the_plan, settings)
        if slurm is not None:
            write_atomically(slurm, slurm_script(the_plan, settings, job_name=settings.rdzv_id))
        if local and not dry_run:
            start_local(launches)
            return
        if as_json:
            typer.echo(json.dumps(launches_json(launches), indent=1))
        else:
            typer.echo(describe(plan, the_plan, launches))
        if slurm is not None and not as_json:
            typer.echo(f"\nwrote {printable(slurm)}: submit it with sbatch {shell_quote(str(slurm))}")


def start_local(launches: list[NodeLaunch]) -> None:
    """Run the agents here; exit with their outcome (one line on stderr when it needs one)."""
    from medley.cli.errors import print_error
    from medley.errors import debug_enabled
    from medley.runtime.agents import Stopped, run_agents

    try:
        code, line = run_agents(launches, debug=debug_enabled())
    except Stopped as stop:
        print_error(f"stopped ({stop}): the agents and ranks were stopped; run again to resume from the "
                    "newest checkpoint")
        raise typer.Exit(code=128 + stop.signum) from None
    if line is not None:
        print_error(line)
    if code:
        raise typer.Exit(code=code)
