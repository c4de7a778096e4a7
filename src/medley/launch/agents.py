"""Run every node's torchrun agent on this machine (``medley launch --local``) and report one outcome.

Each agent is a subprocess (fork + exec of ``python -m torch.distributed.run``) with its node's
environment. Their output is passed through line by line: the ranks' stdout as it is (rank 0's
``--json`` records, whichever agent holds rank 0), their stderr without torchelastic's own logs and
failure reports (all shown with ``--debug``), each ``error:`` line once however many ranks print it.
When an agent fails, the others get a short grace to report their own cause, then are stopped; a
failure without an ``error:`` line of the ranks becomes one line naming the node and the rank.

The agents and their ranks never outlive this process: each agent learns its pid
(``MEDLEY_LAUNCHER_PID``) and, run as :mod:`medley.launch.local_agent`, dies with it (a ``kill -9``
included); SIGTERM and SIGHUP stop them first, as Ctrl-C does (:class:`Stopped`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

from medley.launch.nodes import ELASTIC_DIR_ENV, LAUNCHER_PID_ENV, NodeLaunch

GRACE_S = 3.0  # how long the other agents may still report after the first one failed
STOP_S = 10.0  # how long a stopped agent may take before it is killed
_POLL_S = 0.1
# torch's own lines: its Python logs (W1201 00:08:51.342000 ...), its C++ warnings ([W1201 00:16:21.80 ...])
# with their stack frames, and the blank lines between them.
# torchrun's OMP_NUM_THREADS banner too (a node's agent started without it set, as over ssh).
_TORCH_NOISE = re.compile(r"^(\[?[DIWEF]\d{4} \d\d:\d\d:\d\d|Exception raised from |frame #\d+: |"
                          r"<omitting python frames>|\*{20,}\s*$|Setting OMP_NUM_THREADS environment |\s*$)")
_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):  # noqa: N818 - it reports a stop, not a failure
    """The launcher got SIGTERM or SIGHUP (``signum``); the agents were stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(kw_only=True)
class _Agent:
    """One running agent and what its stderr said.

    Attributes:
        launch: the node it runs.
        process: the torchrun subprocess.
        report: torchelastic's failure report (from its traceback on), kept for the summary line.
    """

    launch: NodeLaunch
    process: subprocess.Popen[str]
    report: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class _Output:
    """Where the agents' lines go; the ``error:`` lines already shown (each once)."""

    debug: bool
    prefix: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    errors: set[str] = field(default_factory=set)

    def write(self, stream: IO[str], line: str) -> None:
        with self.lock:
            stream.write(line)
            stream.flush()

    def stderr_line(self, agent: _Agent, line: str) -> None:
        # Nodes on other machines (``prefix``): each line shown says whose it is.
        shown = f"[{agent.launch.node}] {line}" if self.prefix else line
        if self.debug:
            self.write(sys.stderr, shown)
            return
        if agent.report or line.startswith("Traceback (most recent call last)"):
            agent.report.append(line)
            return
        if _TORCH_NOISE.match(line):
            return
        if line.startswith("error:"):
            with self.lock:
                if line in self.errors:
                    return
                self.errors.add(line)
        self.write(sys.stderr, shown)


def _pump(source: IO[str], sink: Callable[[str], None]) -> None:
    for line in iter(source.readline, ""):
        sink(line)
    source.close()


def _start(launch: NodeLaunch, output: _Output, *, keep_stdin: bool) -> tuple[_Agent, list[threading.Thread]]:
    env = {**os.environ, **launch.env, LAUNCHER_PID_ENV: str(os.getpid())}
    process = subprocess.Popen(launch.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.PIPE if keep_stdin else None, text=True, bufsize=1)
    agent = _Agent(launch=launch, process=process)
    assert process.stdout is not None and process.stderr is not None
    threads = [threading.Thread(target=_pump, args=(process.stdout, lambda ln: output.write(sys.stdout, ln)),
                                daemon=True),
               threading.Thread(target=_pump, args=(process.stderr, lambda ln: output.stderr_line(agent, ln)),
                                daemon=True)]
    for thread in threads:
        thread.start()
    return agent, threads


def _stop(agents: list[_Agent]) -> None:
    """SIGTERM to every agent still running (torchrun stops its ranks), SIGKILL after STOP_S. An
    ssh session (its stdin kept open) is first ended by closing its stdin, on which the node stops
    its agent (:mod:`medley.launch.remote`), and given STOP_S to end."""
    sessions = [a for a in agents if a.process.stdin is not None and a.process.poll() is None]
    for agent in sessions:
        with contextlib.suppress(OSError):
            agent.process.stdin.close()
    deadline = time.monotonic() + STOP_S
    while sessions and time.monotonic() < deadline and any(a.process.poll() is None for a in sessions):
        time.sleep(_POLL_S)
    for agent in agents:
        if agent.process.poll() is None:
            agent.process.terminate()
    deadline = time.monotonic() + STOP_S
    for agent in agents:
        try:
            agent.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()


def _wait(agents: list[_Agent], *, elastic: bool = False) -> None:
    """Until every agent ended, or one failed and the others had GRACE_S to end too (elastic:
    until every agent ended; the others go on without a lost one)."""
    failed_at: float | None = None
    while any(a.process.poll() is None for a in agents):
        if not elastic and failed_at is None and any(a.process.poll() not in (None, 0) for a in agents):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            break
        time.sleep(_POLL_S)


def run_agents(launches: list[NodeLaunch], *, debug: bool, elastic: bool = False,
               remote: bool = False) -> tuple[int, str | None]:
    """Start every agent, wait for all; (exit status, one line to print or None). Status 0 when all
    succeeded (elastic: when any did, the run having gone on without the others), 2 when a rank
    refused its input (its ``error:`` line was shown), else 1. Ctrl-C stops every agent and
    re-raises; SIGTERM or SIGHUP stops them and raises :class:`Stopped`. ``remote``: each launch
    is an ssh session (:mod:`medley.launch.remote`): its stderr lines get the node's name, and its
    stdin stays open, the remote agent stopping when it closes (this process stopped it, or died)."""
    output = _Output(debug=debug, prefix=remote)
    agents: list[_Agent] = []
    threads: list[threading.Thread] = []
    try:
        with _stop_signals():
            for launch in launches:
                agent, pumps = _start(launch, output, keep_stdin=remote)
                agents.append(agent)
                threads += pumps
            _wait(agents, elastic=elastic)
    except BaseException:
        _stop(agents)
        raise
    _stop(agents)
    for thread in threads:
        thread.join(timeout=STOP_S)
    if elastic and any(a.process.returncode == 0 for a in agents):
        lost = [a for a in agents if a.process.returncode != 0]
        return 0, None if not lost else "; ".join(
            f"node {a.launch.node}: its agent ended ({_how(a.process.returncode)}); the run went on "
            "without it"
            for a in lost)
    host = _rendezvous_host(agents) if elastic else None
    if host is not None and host.process.returncode < 0:  # lost (killed), not failed for its ranks
        return 1, rendezvous_lost_line(host.launch, host.process.returncode)
    return _outcome(agents, shown_error=bool(output.errors))


def _rendezvous_host(agents: list[_Agent]) -> _Agent | None:
    """The agent that serves torchrun's rendezvous store: the one started with ``is_host=1`` in
    its ``--rdzv-conf`` (``--local``), else the first."""
    for agent in agents:
        argv = list(agent.launch.argv)
        conf = argv[argv.index("--rdzv-conf") + 1] if "--rdzv-conf" in argv[:-1] else ""
        if "is_host=1" in conf.split(","):
            return agent
    return agents[0] if agents else None


def rendezvous_lost_line(launch: NodeLaunch, code: int) -> str:
    """The line of an elastic run that ended because the node hosting the rendezvous was lost
    (``code``: its agent's exit status): which node, why the others stopped, how to resume."""
    directory = launch.env.get(ELASTIC_DIR_ENV)
    where = f"the last checkpoint ({directory})" if directory else "the last checkpoint"
    return (f"node {launch.node}: its agent ended ({_how(code)}); it hosted the rendezvous (torchrun's "
            "store), so the other nodes could not go on and were stopped; run the same medley launch "
            f"command again to resume from {where}")


def _how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` (in the main thread, the only one that can)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _root_cause(agent: _Agent) -> tuple[int, int] | None:
    """(rank, exit code) of the root cause in the agent's torchelastic report; negative: a signal."""
    match = _ROOT_CAUSE.search("".join(agent.report).partition("Root Cause")[2])
    return (int(match[1]), int(match[2])) if match else None


def _outcome(agents: list[_Agent], *, shown_error: bool) -> tuple[int, str | None]:
    failed = [a for a in agents if a.process.returncode != 0]
    if not failed:
        return 0, None
    causes = [(a, cause) for a in failed if (cause := _root_cause(a)) is not None]
    if shown_error:
        return (2 if any(code == 2 for _, (_, code) in causes) else 1), None
    # A rank killed by a signal first (the others then fail in their collectives), else a rank's exit.
    causes.sort(key=lambda item: item[1][1] >= 0)
    if not causes:
        agent = failed[0]
        what = f"its torchrun agent failed (exit code {agent.process.returncode})"
    else:
        agent, (rank, code) = causes[0]
        how = f"was killed by signal {-code}" if code < 0 else f"failed (exit code {code})"
        what = f"rank {rank} {how}"
    return 1, (f"node {agent.launch.node}: {what}; the other nodes were stopped "
               "(--debug shows torchrun's report)")
