"""``medley launch PLAN``: what to run on each node the plan uses, an sbatch script for the same,
or (``--local``) every node's torchrun agent started on this machine.

Everything (the plan, the training flags after ``--``, the rendezvous, the output file) is checked
before anything is written or started. The commands come from :mod:`medley.launch.nodes`; the local
agents run under :func:`medley.launch.agents.run_agents`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Annotated

import typer

from medley.cli.error_exit import MedleyInputError, exit_on_input_error, usage_line
from medley.cli.job_file import refuse_plan_settings
from medley.fileio import anchored
from medley.launch.nodes import (
    ENDPOINT_VAR,
    ONE_THREAD_ENV,
    VISIBLE_ENV,
    ElasticSettings,
    LaunchSettings,
    NodeLaunch,
    check_rdzv_id,
    free_port,
    launches_json,
    node_launches,
    python_settings,
    shell_quote,
    slurm_script,
    used_nodes,
)
from medley.launch.remote import over_ssh
from medley.plan.plan import Plan
from medley.runtime.placement import world_size_terms
from medley.spec.cluster_schema import printable

LOCAL_ENV = {VISIBLE_ENV: "", ONE_THREAD_ENV: "1"}  # gloo on CPU, a core per rank
_OWN_FLAGS = {"plan": "--plan", "local_ranks": "--local-ranks"}


def check_train_args(ctx: typer.Context, args: list[str]) -> dict[str, object]:
    """Parse the flags after ``--`` as ``medley train`` would (nothing runs): an unknown flag or a
    bad value, ``--plan`` or ``--local-ranks`` is an input error naming it. Returns the values."""
    root = ctx.find_root()
    train = root.command.get_command(root, "train")  # type: ignore[attr-defined]
    try:
        train_ctx = train.make_context("medley train", list(args))
    except typer.TyperException as err:
        line = usage_line(err) or str(err)
        raise MedleyInputError(f"the training flags after --: {line}") from None
    params = train_ctx.params
    try:
        refuse_plan_settings(train_ctx, plan=ctx.params.get("plan", "of medley launch"))
    except MedleyInputError as err:
        raise MedleyInputError(f"the training flags after --: {err}") from None
    for name, flag in _OWN_FLAGS.items():
        if params.get(name) is not None:
            raise MedleyInputError(f"the training flags after --: {flag} is set by medley launch "
                                   "(one rank per plan device, on its node); remove it")
    return params


def absolute_paths(ctx: typer.Context, args: list[str], params: dict[str, object]) -> list[str]:
    """``args`` (``params``: as :func:`check_train_args` parsed them), with the value of every path
    flag, and of any flag whose value names an existing file here, made absolute: the nodes'
    commands do not depend on the directory they start in."""
    root = ctx.find_root()
    train = root.command.get_command(root, "train")  # type: ignore[attr-defined]
    names = {opt: param.name for param in train.params for opt in param.opts if opt.startswith("--")}
    out, index = [], 0
    while index < len(args):
        arg = args[index]
        flag, eq, inline = arg.partition("=")
        name = names.get(flag)
        takes = name is not None and not isinstance(params.get(name), bool)
        if takes and eq:
            out.append(f"{flag}={_absolute(inline, params[name])}")
        elif takes and index + 1 < len(args):
            out += [arg, _absolute(args[index + 1], params[name])]
            index += 1
        else:
            out.append(arg)
        index += 1
    return out


def _absolute(value: str, parsed: object) -> str:
    """The flag's value as train parsed it (``~`` expanded), made absolute when it is a path."""
    text = str(parsed) if isinstance(parsed, (str, Path)) else value
    return anchored(text, Path.cwd(), is_path=isinstance(parsed, Path))


def default_rdzv_id(plan_path: Path) -> str:
    """The same on every node for the same plan file: ``medley-`` and a hash of its contents."""
    return "medley-" + hashlib.sha256(plan_path.read_bytes()).hexdigest()[:10]


def local_settings(plan_path: Path, train_args: list[str], *, rdzv_endpoint: str | None = None,
                   rdzv_id: str | None = None) -> LaunchSettings:
    """Every agent on this machine: this Python's torchrun and medley, 127.0.0.1 and a free port
    (or the rendezvous given: a node that joins a running elastic job); the agents and their
    ranks die with this process (:mod:`medley.launch.local_agent`)."""
    script = Path(sys.executable).with_name("medley")
    program = ("--no-python", str(script)) if script.exists() else ("-m", "medley.cli.main")
    env = dict(LOCAL_ENV)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun would set, without its banner on stdout
    return LaunchSettings(plan_path=str(plan_path.resolve()), train_args=tuple(train_args),
                          rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}",
                          rdzv_id=rdzv_id or f"medley-{uuid.uuid4().hex[:10]}",
                          launcher=(sys.executable, "-m", "medley.launch.local_agent"), program=program,
                          extra_env=env)


def on_cpu_by_choice(params: dict[str, object]) -> bool:
    """Whether the training flags (as :func:`check_train_args` parsed them) run a GPU plan on the
    CPU on purpose: ``--device cpu``, ``--emulate`` or ``--slowdown``."""
    return params.get("device") == "cpu" or bool(params.get("emulate")) or bool(params.get("slowdown"))


def checked_command(launch: NodeLaunch, *, plan_path: str, cpu: bool, wrap: bool = False,
                    check_to_stderr: bool = False) -> str:
    """The node's command behind its check: ``ENV PYTHON -m medley.cli.main doctor --plan P --node N
    && ENV PYTHON -m torch.distributed.run ...``, so that a node without the plan's GPUs (or a CPU
    build of torch) says why and starts nothing (``--device cpu`` when the run is on the CPU on
    purpose). ``wrap``: the torchrun command on a line of its own (after ``&&``, the shell reads on).
    ``check_to_stderr``: the check's report on stderr, stdout left to the ranks (``--json``)."""
    doctor = (launch.argv[0], "-m", "medley.cli.main", "doctor", "--plan", plan_path, "--node", launch.node,
              *(("--device", "cpu") if cpu else ()))
    assignments = [f"{key}={shell_quote(value)}" for key, value in launch.env.items()]
    check = " ".join([*assignments, *map(shell_quote, doctor)]) + (" >&2" if check_to_stderr else "")
    return check + (" &&\n" if wrap else " && ") + launch.command


def checked_json(launches: list[NodeLaunch], *, plan_path: str,
                 cpu: bool) -> dict[str, list[dict[str, object]]]:
    """:func:`medley.launch.nodes.launches_json` with each ``command`` behind its check
    (:func:`checked_command`)."""
    data = launches_json(launches)
    for entry, launch in zip(data["nodes"], launches, strict=True):
        entry["command"] = checked_command(launch, plan_path=plan_path, cpu=cpu)
    return data


def check_local_devices(plan: Plan, *, cpu: bool) -> None:
    """``--local`` runs every node's ranks on this machine's CPU (no GPU visible): a GPU plan
    needs ``--emulate`` or ``--device cpu`` after ``--``; refused before any agent starts."""
    from medley.cli.preflight import check_devices
    from medley.runtime.device_check import NodeDevices, probe

    here = probe()
    hidden = NodeDevices(torch_version=here.torch_version, cuda_version=here.cuda_version)
    check_devices(plan, device="cpu" if cpu else "auto", emulate=False,
                  local_ranks=plan.world_size, found=hidden,
                  command="launch --local (every node's ranks on this CPU)")


def describe(plan_path: Path, plan: Plan, launches: list[NodeLaunch], *, plan_file: str,
             cpu: bool = False) -> str:
    """The commands for people: a header, then per node its host, devices and command line (behind
    the node's ``medley doctor``: :func:`checked_command`)."""
    endpoint = launches[0].argv[launches[0].argv.index("--rdzv-endpoint") + 1]
    lines = [f"{printable(plan_path)}: {len(launches)} nodes, {plan.world_size} ranks "
             f"({world_size_terms(plan)}); rendezvous {endpoint} (c10d). Run on each node, with the plan "
             "file at that path there:"]
    for launch in launches:
        host, devices = printable(launch.host or "host not given"), ",".join(map(str, launch.devices))
        lines += ["", f"# node {printable(launch.node)} ({host}): devices {devices}",
                  checked_command(launch, plan_path=plan_file, cpu=cpu, wrap=True)]
    return "\n".join(lines)


def elastic_settings(params: dict[str, object], *, min_nodes: int, max_restarts: int) -> ElasticSettings:
    """The elastic rendezvous of ``medley launch --elastic``; the training flags (``params``, as
    :func:`check_train_args` parsed them) must name a checkpoint directory and interval."""
    directory, every = params.get("checkpoint_dir"), params.get("checkpoint_every") or 0
    if directory is None or not isinstance(every, int) or every < 1:
        raise MedleyInputError("--elastic: give the training flags --checkpoint-dir DIR (on a file system "
                               "every node shares) and --checkpoint-every N after --; a lost node's steps "
                               "are redone from the newest checkpoint")
    return ElasticSettings(min_nodes=min_nodes, max_restarts=max_restarts,
                           checkpoint_dir=str(Path(str(directory)).absolute()))


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
        ssh: Annotated[bool, typer.Option(help=(
            "Start every node's agent on its host (the cluster file's) over ssh; their output here, each "
            "line with its node; every node stopped when one fails"))] = False,
        dry_run: Annotated[bool, typer.Option(help="Print the commands, start nothing")] = False,
        python: Annotated[str | None, typer.Option(help=(
            "Python on the nodes, with medley installed (default: this one, as an absolute path)"))] = None,
        log_dir: Annotated[str | None, typer.Option(help=(
            "Every rank's output also goes to LOG_DIR/<node>/ (torchrun --log-dir, --tee)"))] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the commands as JSON")] = False,
        elastic: Annotated[bool, typer.Option("--elastic", help=(
            "Keep training when nodes are lost, return or slow down: torchrun's elastic rendezvous, a "
            "re-plan for the devices present, resume from the newest checkpoint"))] = False,
        min_nodes: Annotated[int, typer.Option(min=1, help=(
            "Elastic: the fewest nodes the run goes on with"))] = 1,
        max_restarts: Annotated[int, typer.Option(min=0, help=(
            "Elastic: restarts after failures (lost nodes) per agent; joining nodes do not count"))] = 3,
        node: Annotated[list[str] | None, typer.Option(help=(
            "Start only this node's agent (--local; repeatable): a node that returns to a running "
            "elastic job, with its --rdzv-endpoint and --rdzv-id"))] = None,
    ) -> None:
        """Run a plan on its nodes: one torchrun agent per node the plan uses (its devices only)."""
        from medley.fileio import check_output_file, write_atomically
        from medley.plan.plan import load_plan

        check_flags(local=local, slurm=slurm, as_json=as_json, dry_run=dry_run, rdzv_id=rdzv_id)
        if ssh and (local or slurm is not None or elastic or as_json):
            raise MedleyInputError("--ssh: starts every node over ssh; give it without --local, --slurm, "
                                   "--elastic and --json (for the records as JSON put --json after --)")
        if elastic and slurm is not None:
            raise MedleyInputError("--elastic --slurm: the sbatch script stops every node when one fails, so "
                                   "it is not written for elastic runs; run the commands of --elastic "
                                   "--dry-run on the nodes (srun one per node) instead")
        if node and not local:
            raise MedleyInputError("--node starts one node's agent here: use it with --local; on real nodes "
                                   "run that node's command (--dry-run prints it)")
        if slurm is not None:
            check_output_file(slurm, flag="--slurm")
        the_plan = load_plan(plan)
        params = check_train_args(ctx, list(train_args or []))  # parsed once, as train parses them
        args = absolute_paths(ctx, list(train_args or []), params)
        cpu = on_cpu_by_choice(params)
        extra = None
        if elastic:
            extra = elastic_settings(params, min_nodes=min_nodes, max_restarts=max_restarts)
        if local:
            here = local_settings(plan, args, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
            extra = None if extra is None else dataclasses.replace(extra, first_hosts=True)
            settings = dataclasses.replace(here, log_dir=log_dir, elastic=extra)
        else:
            python_parts = python_settings(python or sys.executable)
            if elastic:  # the agent waits to be admitted when it joins a running job
                python_parts["launcher"] = (python or sys.executable, "-m", "medley.launch.local_agent")
            settings = LaunchSettings(plan_path=str(plan.absolute()), train_args=tuple(args),
                                      rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id or default_rdzv_id(plan),
                                      log_dir=log_dir, elastic=extra, **python_parts)
        if slurm is not None:
            write_atomically(slurm, slurm_script(the_plan, settings, job_name=settings.rdzv_id))
            hosts_known = all(node.host is not None for node, _ in used_nodes(the_plan))
            # Without hosts the script takes the rendezvous from the allocation's first host.
            launches = node_launches(the_plan, settings, endpoint=None if rdzv_endpoint or hosts_known
                                     else ENDPOINT_VAR)
        else:
            launches = node_launches(the_plan, settings)
        if node:
            launches = only_nodes(launches, node)
        if local and not dry_run:
            check_local_devices(the_plan, cpu=cpu)
            start_local(launches, elastic=elastic)
            return
        if ssh:
            remote = [over_ssh(launch, checked_command(launch, plan_path=settings.plan_path, cpu=cpu,
                                                       check_to_stderr=True)) for launch in launches]
            if not dry_run:
                start_local(remote, remote=True)
                return
            typer.echo("\n".join(" ".join(map(shell_quote, launch.argv)) for launch in remote))
            return
        if as_json:
            typer.echo(json.dumps(checked_json(launches, plan_path=settings.plan_path, cpu=cpu), indent=1))
        else:
            typer.echo(describe(plan, the_plan, launches, plan_file=settings.plan_path, cpu=cpu))
        if slurm is not None and not as_json:
            typer.echo(f"\nwrote {printable(slurm)}: submit it with sbatch {shell_quote(str(slurm))}")


def only_nodes(launches: list[NodeLaunch], names: list[str]) -> list[NodeLaunch]:
    """The launches of the nodes ``names`` (``--node``), each a node the plan uses."""
    known = [launch.node for launch in launches]
    for name in names:
        if name not in known:
            raise MedleyInputError(f"--node {printable(name)}: not a node the plan uses (it uses "
                                   f"{', '.join(map(printable, known))}); give one of them")
    return [launch for launch in launches if launch.node in names]


def start_local(launches: list[NodeLaunch], *, elastic: bool = False, remote: bool = False) -> None:
    """Run the agents here (``remote``: their ssh sessions); exit with their outcome (one line on
    stderr when it needs one)."""
    from medley.cli.error_exit import one_line, print_error
    from medley.errors import debug_enabled
    from medley.launch.agents import Stopped, run_agents

    try:
        code, line = run_agents(launches, debug=debug_enabled(), elastic=elastic, remote=remote)
    except Stopped as stop:
        print_error(f"stopped ({stop}): the agents and ranks were stopped; run again to resume from the "
                    "newest checkpoint")
        raise typer.Exit(code=128 + stop.signum) from None
    if line is not None and code:
        print_error(line)
    elif line is not None:  # an elastic run that went on without some nodes
        typer.echo(one_line(line), err=True)
    if code:
        raise typer.Exit(code=code)
