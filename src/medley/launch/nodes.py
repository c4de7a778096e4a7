"""What each node of a plan runs: one torchrun agent per node the plan uses (``medley launch``).

A node's agent starts one rank per plan device on it (``--nproc-per-node``: nodes differ), joins
the others at a c10d rendezvous (the first used node's ``host`` on port 29500, or an endpoint the
user gives) and runs ``medley train --plan PLAN`` plus the user's training flags. Its environment
names the node (``MEDLEY_NODE``, how a rank learns which cluster node it is on) and lists the
node's plan devices, by their index on the node, in ascending device id (``CUDA_VISIBLE_DEVICES``:
LOCAL_RANK i is the i-th of them). Devices the plan does not use start no rank, and a node without
plan devices starts no agent. With ``--elastic`` (:class:`ElasticSettings`) the agents meet at
torchrun's elastic rendezvous and the ranks re-plan for whoever is there (:mod:`medley.elastic`).
Pure text: nothing here imports torch or starts a process.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
from dataclasses import dataclass, field

from medley.errors import MedleyInputError
from medley.plan.plan import Plan
from medley.runtime.placement import NODE_ENV, plan_devices_by_node
from medley.spec.cluster import Node
from medley.spec.cluster_schema import printable

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ONE_THREAD_ENV = "MEDLEY_ONE_THREAD_PER_RANK"  # "1": each rank computes on one thread (CPU ranks)
LAUNCHER_PID_ENV = "MEDLEY_LAUNCHER_PID"  # agents and ranks started here exit when this process dies
RDZV_PORT = 29500
ENDPOINT_VAR = "${MEDLEY_RDZV_ENDPOINT}"  # the SLURM script sets it (from the plan or SLURM's node list)
TORCHRUN = ("torchrun",)
MEDLEY = ("--no-python", "medley")
_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9_][A-Za-z0-9_.\-]*|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{1,5}))?")
_RDZV_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # "1": rank 0 hosts each attempt's own store
ELASTIC_FLAG = "--elastic"  # medley train's flag: this rank is one of an elastic run (medley.elastic)
ELASTIC_DIR_ENV = "MEDLEY_ELASTIC_CHECKPOINT_DIR"  # a joining agent waits for admission there


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    """How the agents of an elastic run (``medley launch --elastic``) meet and restart.

    Attributes:
        min_nodes: the fewest nodes the run goes on with (torchrun ``--nnodes MIN:MAX``; MAX is
            every node the plan uses).
        max_restarts: how often each agent restarts its ranks after a failure (a lost node);
            a node that joins restarts them without counting.
        last_call_s: how long the rendezvous waits for more nodes once ``min_nodes`` are there.
        keep_alive_s: how often an agent says it is alive; three missed and it is taken as lost.
        checkpoint_dir: the run's ``--checkpoint-dir`` as the nodes see it (a node that joins a
            running job waits there to be admitted at the next checkpoint).
        first_hosts: the first node's agent hosts the rendezvous store and the others never do
            (``--local``: every agent is on 127.0.0.1 and would race for it); False: the agent on
            the endpoint's host does, as torchrun decides.
    """

    min_nodes: int = 1
    max_restarts: int = 3
    last_call_s: int = 5
    keep_alive_s: int = 2
    checkpoint_dir: str | None = None
    first_hosts: bool = False

    def torchrun_args(self, nodes: int, *, first: bool) -> tuple[str, ...]:
        conf = (f"join_timeout=600,last_call_timeout={self.last_call_s},"
                f"keep_alive_interval={self.keep_alive_s},keep_alive_max_attempt=3")
        if self.first_hosts:
            conf += f",is_host={int(first)}"
        return ("--nnodes", f"{min(self.min_nodes, nodes)}:{nodes}", "--max-restarts", str(self.max_restarts),
                "--rdzv-conf", conf)

    def env(self) -> dict[str, str]:
        dirs = {} if self.checkpoint_dir is None else {ELASTIC_DIR_ENV: self.checkpoint_dir}
        return {SHARED_STORE_ENV: "1", **dirs}


@dataclass(frozen=True, kw_only=True)
class LaunchSettings:
    """How every node's agent is started.

    Attributes:
        plan_path: the plan file as the nodes see it (passed to ``medley train --plan``).
        train_args: training flags appended to ``medley train --plan PLAN``.
        rdzv_endpoint: ``HOST:PORT`` of the c10d rendezvous; None: the first used node's host.
        rdzv_id: the rendezvous (job) id, the same on every node.
        launcher: the torchrun command (``python -m torch.distributed.run`` for ``--local``).
        program: what torchrun runs, before ``train`` (``--no-python medley``).
        extra_env: more variables for every agent (``--local``: CPU only, one thread per rank).
        log_dir: each node's torchrun writes every rank's stdout and stderr under
            ``LOG_DIR/<node>/`` (``--log-dir``, ``--redirects 3``) and still shows them (``--tee 3``);
            None: the ranks' output goes to the agent's terminal only.
        elastic: the elastic rendezvous and restarts (``--elastic``); None: every node, once.
    """

    plan_path: str
    train_args: tuple[str, ...] = ()
    rdzv_endpoint: str | None = None
    rdzv_id: str = "medley"
    launcher: tuple[str, ...] = TORCHRUN
    program: tuple[str, ...] = MEDLEY
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    elastic: ElasticSettings | None = None


def python_settings(python: str) -> dict[str, tuple[str, ...]]:
    """``launcher`` and ``program`` that need nothing on the nodes' PATH: ``PYTHON -m
    torch.distributed.run ... -m medley.cli.main`` (the venv need not be active there)."""
    return {"launcher": (python, "-m", "torch.distributed.run"), "program": ("-m", "medley.cli.main")}


@dataclass(frozen=True, kw_only=True)
class NodeLaunch:
    """What one node runs.

    Attributes:
        node: the cluster node's name (``MEDLEY_NODE``).
        host: its host name or address from the cluster file; None where the file gives none.
        devices: global ids of the plan's devices on the node, ascending (one rank each).
        local_indices: the same devices' indices on the node (``CUDA_VISIBLE_DEVICES``).
        env: the variables the agent runs with (node name and visible devices).
        argv: the torchrun command line, without the environment.
    """

    node: str
    host: str | None
    devices: tuple[int, ...]
    local_indices: tuple[int, ...]
    env: dict[str, str]
    argv: tuple[str, ...]

    @property
    def nproc(self) -> int:
        return len(self.devices)

    @property
    def command(self) -> str:
        """The shell line: ``NAME=value ... torchrun ...``."""
        assignments = [f"{key}={shell_quote(value)}" for key, value in self.env.items()]
        return " ".join([*assignments, *(_quote(arg) for arg in self.argv)])


def shell_quote(arg: str) -> str:
    """``arg`` as one shell word on one line: shlex's quoting, or bash's ``$'...'`` (ANSI-C) quoting
    when it holds a character that is not printable (a newline, ESC), each such character written
    as the ``\\xHH`` escapes of its bytes (those of the file name, for a path)."""
    if arg.isprintable():
        return shlex.quote(arg)
    return "$'" + "".join(_ANSI_C.get(c) or (c if c.isprintable() else _bytes_escape(c)) for c in arg) + "'"


def _bytes_escape(char: str) -> str:
    try:
        data = os.fsencode(char)
    except UnicodeEncodeError:  # a lone surrogate that is no undecodable file-name byte
        data = char.encode("utf-8", "surrogatepass")
    return "".join(f"\\x{b:02x}" for b in data)


def _quote(arg: str) -> str:
    """``arg`` for a shell line; the SLURM script's endpoint variable stays a variable."""
    return f'"{arg}"' if arg == ENDPOINT_VAR else shell_quote(arg)


def check_rdzv_id(text: str, *, flag: str = "--rdzv-id") -> str:
    """``text`` if it is a rendezvous (and SLURM job) id: 1-64 letters, digits, '.', '_' or '-'."""
    if _RDZV_ID.fullmatch(text) is None:
        raise MedleyInputError(f"{flag} '{printable(text)}': use 1-64 letters, digits, '.', '_' or '-'")
    return text


def used_nodes(plan: Plan) -> list[tuple[Node, tuple[int, ...]]]:
    """The nodes holding plan devices, in cluster order, each with its plan devices (ascending)."""
    by_node = plan_devices_by_node(plan)
    return [(node, tuple(by_node[node.name])) for node in plan.cluster.nodes if node.name in by_node]


def parse_endpoint(text: str, *, flag: str = "--rdzv-endpoint") -> str:
    """``HOST[:PORT]`` as ``HOST:PORT`` (port 29500 by default); anything else is an input error."""
    match = _ENDPOINT.fullmatch(text)
    if match is None or not 1 <= int(match["port"] or RDZV_PORT) <= 65535:
        raise MedleyInputError(
            f"{flag} '{printable(text)}': not HOST:PORT; give a host name or address and a port "
            f"1-65535, e.g. gpu-a100-1:{RDZV_PORT}")
    return f"{match['host']}:{int(match['port'] or RDZV_PORT)}"


def rendezvous_endpoint(plan_path: str, nodes: list[tuple[Node, tuple[int, ...]]], given: str | None) -> str:
    """The endpoint every agent meets at: ``given``, else the first used node's host on port 29500."""
    if given is not None:
        return parse_endpoint(given)
    first = nodes[0][0]
    if first.host is None:
        raise MedleyInputError(
            f"{plan_path}: node '{first.name}' (the first node the plan uses, which hosts the rendezvous) "
            f"has no host; add host = \"...\" to its [[nodes]] entry of the cluster file and re-make the "
            f"plan, or pass --rdzv-endpoint HOST:{RDZV_PORT}")
    return parse_endpoint(first.host, flag=f"{plan_path}: node '{first.name}' host")


def node_launches(plan: Plan, settings: LaunchSettings, *, endpoint: str | None = None) -> list[NodeLaunch]:
    """One :class:`NodeLaunch` per node the plan uses, in cluster order. ``endpoint`` (taken as
    it is) replaces the rendezvous endpoint of ``settings``."""
    nodes = used_nodes(plan)
    if endpoint is None:
        endpoint = rendezvous_endpoint(settings.plan_path, nodes, settings.rdzv_endpoint)
    launches = []
    for index, (node, devices) in enumerate(nodes):
        local = tuple(plan.cluster.devices[d].local_rank for d in devices)
        logs = () if settings.log_dir is None else (
            "--log-dir", f"{settings.log_dir.rstrip('/')}/{node.name}", "--redirects", "3", "--tee", "3")
        elastic = settings.elastic
        size = ("--nnodes", str(len(nodes))) if elastic is None else \
            elastic.torchrun_args(len(nodes), first=index == 0)
        argv = (*settings.launcher, *size, "--nproc-per-node", str(len(devices)),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", settings.rdzv_id, *logs,
                *settings.program, "train", "--plan", settings.plan_path,
                *(() if elastic is None else (ELASTIC_FLAG,)), *settings.train_args)
        env = {NODE_ENV: node.name, VISIBLE_ENV: ",".join(map(str, local)), **settings.extra_env,
               **({} if elastic is None else elastic.env())}
        launches.append(NodeLaunch(node=node.name, host=node.host, devices=devices, local_indices=local,
                                   env=env, argv=argv))
    return launches


def launches_json(launches: list[NodeLaunch]) -> dict[str, list[dict[str, object]]]:
    """``{"nodes": [{"node", "host", "devices", "command"}, ...]}`` (``medley launch --json``)."""
    return {"nodes": [{"node": n.node, "host": n.host, "devices": list(n.devices), "command": n.command}
                      for n in launches]}


def slurm_script(plan: Plan, settings: LaunchSettings, *, job_name: str) -> str:
    """An sbatch script that runs every node's agent as one SLURM task (``srun``) on its host: the
    cluster file's hosts where every used node has one, else the allocation's hosts in plan order.
    The job asks for the GPUs its steps use: ``--gres=gpu:N`` when every node uses N, else one
    component per node (SLURM's heterogeneous job, ``#SBATCH hetjob``), each with its own count,
    its step run in it (``srun --het-group=i``).
    The rendezvous is ``settings.rdzv_endpoint``, else the first node's host on port 29500."""
    nodes = used_nodes(plan)
    launches = node_launches(plan, settings, endpoint=ENDPOINT_VAR)
    check_rdzv_id(job_name, flag="the SLURM job name")
    hosts = [n.host for n in launches]
    known = all(h is not None for h in hosts)
    if settings.rdzv_endpoint is not None:
        endpoint = shell_quote(parse_endpoint(settings.rdzv_endpoint))
    elif known:
        endpoint = shell_quote(rendezvous_endpoint(settings.plan_path, nodes, None))
    else:
        endpoint = f'"${{hosts[0]}}:{RDZV_PORT}"'
    counts = {n.nproc for n in launches}
    het = len(counts) > 1  # nodes that use different GPU counts: one component per node (hetjob)
    lines = ["#!/bin/bash",
             f"# medley launch --slurm: {printable(settings.plan_path)} on {len(launches)} nodes, "
             f"{sum(n.nproc for n in launches)} ranks. Submit with sbatch; add your partition, account,",
             "# time and --cpus-per-task lines as your site needs.",
             f"#SBATCH --job-name={job_name}"]
    if het:
        lines.append("# The nodes use different GPU counts: a heterogeneous job, one component per node "
                     "(#SBATCH hetjob), each asking for its own GPUs.")
        for i, launch in enumerate(launches):
            if i:
                lines.append("#SBATCH hetjob")
            where = f" --nodelist={printable(str(launch.host))}" if known else ""
            lines.append(f"#SBATCH --nodes=1 --ntasks=1 --gres=gpu:{launch.nproc}{where}")
    else:
        lines += [f"#SBATCH --nodes={len(launches)}", "#SBATCH --ntasks-per-node=1",
                  f"#SBATCH --gres=gpu:{counts.pop()}"]
        if known:
            lines.append(f"#SBATCH --nodelist={','.join(printable(h) for h in hosts)}")
    lines.append("set -u")
    if het:
        lines.append("hosts=()")
        lines += [f'hosts+=($(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{i}"))'
                  for i in range(len(launches))]
    else:
        lines.append('hosts=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))')
    if not known:
        lines.append("# node i of the plan runs on the allocation's i-th host: make sure these are the right "
                     "machines (--nodelist or constraints)")
    lines += [f"MEDLEY_RDZV_ENDPOINT={endpoint}", "pids=()"]
    for i, launch in enumerate(launches):
        host = shell_quote(str(launch.host)) if known else f'"${{hosts[{i}]}}"'
        group = f" --het-group={i}" if het else ""
        step = f"srun{group} --nodes=1 --ntasks=1 --nodelist={host} --gres=gpu:{launch.nproc}"
        lines += [f"# node {printable(launch.node)}: devices {','.join(map(str, launch.devices))}",
                  f"{step} env {launch.command} &",
                  "pids+=($!)"]
    # Each node's status by its pid: `wait -n` may answer 127 (no child) when the steps have already
    # exited, which read as a failure; `wait PID` keeps an exited child's status.
    lines += ['while [ "${#pids[@]}" -gt 0 ]; do',
              '  for i in "${!pids[@]}"; do',
              '    kill -0 "${pids[$i]}" 2>/dev/null && continue',
              '    if ! wait "${pids[$i]}"; then',
              '      unset "pids[$i]"',
              '      echo "medley: a node failed; stopping the others" >&2',
              '      kill "${pids[@]}" 2>/dev/null',
              "      wait",
              "      exit 1",
              "    fi",
              '    unset "pids[$i]"',
              "  done",
              '  if [ "${#pids[@]}" -gt 0 ]; then sleep 1; fi',
              "done", ""]
    return "\n".join(lines)


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it), for a local rendezvous or store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
