"""``medley doctor``: what this node can run, against a plan's devices on it.

It prints torch's version and build (CUDA or CPU), the GPUs CUDA sees (name, memory, catalog type),
NCCL's version, and the network interface NCCL and gloo would use (``NCCL_SOCKET_IFNAME`` /
``GLOO_SOCKET_IFNAME`` when set, else the default route's interface from ``/proc/net/route``).
With ``--plan`` it checks the node's plan devices (``--node``, else ``MEDLEY_NODE``, else the
node whose ``host`` is this machine, else every node as ``--local-ranks`` plays them) with
:func:`medley.runtime.device_check.device_problems`: one line per problem on stderr and exit 2.
``medley launch`` puts it in front of every node's command, so a node that fails never starts.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from medley.cli.error_exit import MedleyInputError, exit_on_input_error, print_error
from medley.plan.plan import Plan
from medley.runtime.device_check import NodeDevices, device_problems, planned_here
from medley.spec.catalog import device_type_for_cuda
from medley.spec.cluster_schema import printable

ROUTES = Path("/proc/net/route")
_RTF_UP = 0x1


@dataclass(frozen=True, kw_only=True)
class Interface:
    """The network interface a library would use.

    Attributes:
        name: the interface (``eth0``), or None when none was found.
        source: where it comes from: the variable that sets it, or ``default route``.
    """

    name: str | None
    source: str


def default_route_interface(routes: str) -> str | None:
    """The interface of the lowest-metric default route in ``/proc/net/route``'s text."""
    best: tuple[int, str] | None = None
    for line in routes.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 7 or fields[1] != "00000000":
            continue
        try:
            flags, metric = int(fields[3], 16), int(fields[6])
        except ValueError:
            continue
        if flags & _RTF_UP and (best is None or metric < best[0]):
            best = (metric, fields[0])
    return None if best is None else best[1]


def interface(variable: str, *, env: dict[str, str], routes: str) -> Interface:
    """``variable``'s value when set (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), else the default
    route's interface."""
    given = env.get(variable)
    if given:
        return Interface(name=given, source=variable)
    return Interface(name=default_route_interface(routes), source="default route")


def _read_routes() -> str:
    try:
        return ROUTES.read_text()
    except OSError:
        return ""


def this_node(plan: Plan, node: str | None, *, env: dict[str, str], hostname: str) -> str | None:
    """The plan node this machine is: ``node`` (``--node``), else ``MEDLEY_NODE``, else the one
    whose ``host`` is this machine; None: none of them (it plays every node)."""
    from medley.runtime.placement import NODE_ENV, plan_devices_by_node

    used = list(plan_devices_by_node(plan))
    chosen = node if node is not None else env.get(NODE_ENV)
    if chosen is not None:
        if chosen not in used:
            flag = "--node" if node is not None else NODE_ENV
            raise MedleyInputError(f"{flag} {printable(chosen)}: not a node the plan uses (it uses "
                                   f"{', '.join(map(printable, used[:8]))}); give one of them")
        return chosen
    short = hostname.split(".")[0].lower()
    matches = [n.name for n in plan.cluster.nodes if n.name in used and n.host is not None
               and n.host.lower() in (hostname.lower(), short)]
    return matches[0] if len(matches) == 1 else None


def report(plan: Plan | None, node: str | None, found: NodeDevices, *, env: dict[str, str], routes: str,
           hostname: str, device: str = "auto") -> dict[str, object]:
    """What ``medley doctor --json`` prints: this node, its torch and GPUs, the interfaces, the
    plan's devices here and the problems (empty: the node can run them)."""

    def catalog(name: str) -> str | None:
        try:
            return device_type_for_cuda(name).name
        except MedleyInputError:
            return None

    out: dict[str, object] = {
        "host": hostname, "node": node, "torch": found.torch_version, "cuda": found.cuda_version,
        "nccl": found.nccl_version,
        "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes,
                  "catalog": catalog(g.name)} for g in found.gpus],
        "network": {lib: vars(interface(var, env=env, routes=routes))
                    for lib, var in (("nccl", "NCCL_SOCKET_IFNAME"), ("gloo", "GLOO_SOCKET_IFNAME"))},
        "planned": [], "problems": []}
    if plan is not None:
        out["planned"] = [{"device": d, "type": plan.cluster.devices[d].type.name}
                          for d in planned_here(plan, node)]
        out["problems"] = [] if device == "cpu" else device_problems(plan, found, node=node)
    return out


def describe(data: dict, *, plan_path: Path | None) -> list[str]:
    """``report`` for people, one fact a line."""
    gpus = data["gpus"]
    build = "a CPU build" if data["cuda"] is None else f"CUDA {data['cuda']}"
    lines = [f"host {printable(str(data['host']))}: torch {data['torch']} ({build}); NCCL "
             f"{data['nccl'] or 'none (no CUDA)'}"]
    if not gpus:
        lines.append("GPUs: none visible")
    for g in gpus:
        kind = g["catalog"] or "not in the catalog"
        lines.append(f"cuda:{g['index']}: {printable(g['name'])}, {g['memory_bytes'] / 1e9:.1f} GB ({kind})")
    for lib, net in data["network"].items():
        lines.append(f"{lib} interface: {net['name'] or 'none found'} ({net['source']})")
    if plan_path is not None:
        node = data["node"]
        where = f"node '{printable(node)}'" if node is not None else "every node (no --node, no host match)"
        planned = ", ".join(f"{p['device']}: {p['type']}" for p in data["planned"]) or "none"
        verdict = "can run them" if not data["problems"] else "cannot run them"
        lines.append(f"plan {printable(str(plan_path))}, {where}: devices {planned}; this node {verdict}")
    return lines


def register(app: typer.Typer) -> None:
    @app.command("doctor")
    @exit_on_input_error
    def doctor_cmd(
        plan: Annotated[Path | None, typer.Option(
            help="Check this node against the plan's devices on it")] = None,
        node: Annotated[str | None, typer.Option(help=(
            "The plan node this machine is (default: MEDLEY_NODE, else the node whose host this "
            "is)"))] = None,
        device: Annotated[str, typer.Option(help=(
            "auto: the plan's GPUs must be here; cpu: the run computes on the CPU on purpose (--device cpu "
            "or --emulate of medley train), so only the rest is reported"))] = "auto",
        as_json: Annotated[bool, typer.Option("--json", help="The report as JSON")] = False,
    ) -> None:
        """This node's torch, CUDA, GPUs, NCCL and network interface, checked against a plan's devices
        on it (exit 2, one line per problem, when it does not have them)."""
        from medley.plan.plan import load_plan
        from medley.runtime.device_check import DEVICE_CHOICES, probe

        if device not in DEVICE_CHOICES:
            raise MedleyInputError(f"--device '{printable(device)}' must be auto or cpu")
        if node is not None and plan is None:
            raise MedleyInputError("--node names a node of a plan: give --plan PLAN too")
        the_plan = load_plan(plan) if plan is not None else None
        env = dict(os.environ)
        hostname = socket.gethostname()
        here = None if the_plan is None else this_node(the_plan, node, env=env, hostname=hostname)
        data = report(the_plan, here, probe(), env=env, routes=_read_routes(), hostname=hostname,
                      device=device)
        if as_json:
            typer.echo(json.dumps(data, indent=1))
        else:
            typer.echo("\n".join(describe(data, plan_path=plan)))
        problems = data["problems"]
        assert isinstance(problems, list)
        for line in problems:
            print_error(f"doctor: {line}")
        if problems:
            raise typer.Exit(code=2)
