"""Start a plan's ranks on this machine through torch's own launcher (torchelastic, as torchrun).

Each rank initialises the default process group (gloo on CPU, nccl when CUDA has a device per
rank) from the environment the launcher sets, runs :func:`medley.runtime.train.train` and
returns its records; rank 0's come back to the caller. With ``max_restarts``, a failed rank makes
the agent stop every rank and start them all again, and training resumes from the newest
checkpoint (as under ``torchrun --max-restarts``).

Ranks die with their launcher (:func:`medley.runtime.lifecycle.die_with_parent`) and leave SIGINT to
it (the agent stops them). Without ``--debug`` (``MEDLEY_DEBUG``) a failure is one line: a rank's
unexpected exception goes to torchelastic's error file, not to the terminal, torchelastic's logs
are muted, and :func:`train_local` raises :class:`RankFailure` naming the first failed rank.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import logging
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from medley.errors import MedleyInputError, debug_enabled
from medley.launch.nodes import LAUNCHER_PID_ENV, ONE_THREAD_ENV, SHARED_STORE_ENV
from medley.plan.plan import Plan
from medley.runtime import placement
from medley.runtime.config import with_epochs
from medley.runtime.lifecycle import die_with_parent, phase_timeouts, process_group_timeout_s
from medley.runtime.placement import PlacementEntry, ranks_needed
from medley.runtime.train import StepRecord, TrainConfig, TrainHooks, load_data, train

# The rendezvous store's timeout; the process group's own outlasts the watchdog's limits
# (medley.runtime.lifecycle.process_group_timeout_s).
STORE_TIMEOUT_S = 120
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


# A rank whose collective failed because a peer vanished waits this long before it fails itself,
# so the agent (polling every 0.1 s) reports the peer, the cause, rather than this symptom.
PEER_GRACE_S = 3.0
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_a_peer(err: BaseException) -> bool:
    """True for the errors a collective raises when another rank died."""
    return any(text in str(err) for text in _PEER_LOST)


class RankFailure(RuntimeError):
    """A launched rank failed (an exception, a signal, a step timeout): one line naming it."""


def uses_cuda(local_world: int) -> bool:
    """Whether ``local_world`` ranks on this machine each get a GPU (nccl), else gloo on CPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world


def init_process_group(config: TrainConfig, *, store: dist.Store | None = None, rank: int = -1,
                       world_size: int = -1) -> str:
    """The default process group of a run of ``config``: from torchrun's environment, or over
    ``store`` as ``rank`` of ``world_size`` (elastic runs); nccl only with a GPU per local rank,
    and gloo whatever there is with ``config.emulation.device`` ``cpu`` (``--device cpu``). Its
    timeout outlasts every limit of the watchdog (``config.logging``'s phase timeouts:
    :func:`~medley.runtime.lifecycle.process_group_timeout_s`), so a hang is named by its line."""
    cpu = config.emulation.device == "cpu"
    on_cuda = not cpu and uses_cuda(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    backend = "nccl" if on_cuda else "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=process_group_timeout_s(phase_timeouts(config.logging)))
        dist.init_process_group(backend, timeout=timeout, store=store, rank=rank, world_size=world_size)
    return backend


class TrainRun(list):
    """Rank 0's step records (a list, as :func:`~medley.runtime.train.train` returns them) and,
    as ``placement``, where every rank ran as the ranks measured it (by global rank); ``plan``:
    the plan the records are of when it is not the launched one (an elastic run re-planned)."""

    placement: list[PlacementEntry]
    plan: Plan | None

    def __init__(self, records: list[StepRecord], placement: list[PlacementEntry],
                 plan: Plan | None = None) -> None:
        super().__init__(records)
        self.placement = list(placement)
        self.plan = plan


@dataclass(frozen=True)
class InputFailure:
    """A rank's :class:`MedleyInputError`, returned (not raised) so the caller can re-raise it."""

    message: str


class _QuietErrorHandler(ErrorHandler):
    """torchelastic's error file, without its crash stack dumps (faulthandler) unless --debug."""

    def initialize(self) -> None:
        if debug_enabled():
            super().initialize()


_ERRORS = _QuietErrorHandler()


def _exit_quietly(signum: int, _frame: object) -> None:
    os._exit(128 + signum)


# An alternative rank body: (records, the plan they are of) on the rank that reports, else None.
RankBody = Callable[[Plan, TrainConfig, "TrainHooks | None"], "tuple[list[StepRecord], Plan] | None"]


@functools.partial(record, error_handler=_ERRORS)
def rank_main(plan: Plan, config: TrainConfig, hooks: TrainHooks | None = None, *,
              body: RankBody | None = None) -> TrainRun | InputFailure | None:
    """Body of one launched rank: records and placement on the rank that reports, None elsewhere.

    ``body`` replaces the default (the process group from torchrun's environment, then
    :func:`~medley.runtime.train.train`; rank 0 reports): it makes its own process group and
    returns the records and their plan on the rank that reports, None on the others (elastic runs)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # Ctrl-C reaches the agent too, which reports it once
        signal.signal(signal.SIGINT, _exit_quietly)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    one_thread = os.environ.get(ONE_THREAD_ENV) == "1"
    torch.set_num_threads(1 if one_thread else max(1, (os.cpu_count() or 1) // local_world))
    if debug_enabled():
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a rank waits
    if body is None:
        init_process_group(config)
    ran: Plan | None = None
    try:
        if body is None:
            records: list[StepRecord] | None = train(plan, config, hooks)
        else:
            records, ran = body(plan, config, hooks) or (None, None)
    except MedleyInputError as err:
        # Bad input fails on every rank alike (plan, flags, checkpoint), so all return.
        return InputFailure(str(err))
    except Exception as err:
        if lost_a_peer(err):  # let the agent see the rank that died first: it reports that one
            time.sleep(PEER_GRACE_S)
        if debug_enabled():
            raise
        _ERRORS.record_exception(err)  # the launcher's one line names it
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if records is None or (body is None and int(os.environ.get("RANK", "0")) != 0):
        return None
    return TrainRun(records, placement.reported(), plan=ran)


def train_local(plan: Plan, config: TrainConfig, *, nprocs: int | None = None, max_restarts: int = 0,
                start_method: str | None = None, hooks: TrainHooks | None = None) -> TrainRun:
    """Train ``plan`` with ``nprocs`` ranks on this machine (default: the plan's world size), which
    plays every node of the plan's cluster (rank i on the plan's i-th device in ascending id).

    ``start_method`` defaults to ``forkserver`` without CUDA and ``spawn`` with CUDA. Ranks forked
    from the caller itself (``fork``) start fastest but can deadlock when the caller already runs
    other threads (a lock held at fork time, seen in the test suite); the fork server is a clean
    single-threaded process with torch and medley already imported, so ranks still start in
    about a second after its first use. Ranks forked either way compute with one thread, as
    ``medley profile`` measures by default, so that profiles predict these runs.
    """
    if start_method is None:
        start_method = "spawn" if torch.cuda.is_available() else "forkserver"
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "medley.launch.spawn"])
    nprocs = plan.world_size if nprocs is None else nprocs
    if nprocs != plan.world_size:
        raise MedleyInputError(
            f"--local-ranks {nprocs}: the plan needs {ranks_needed(plan)}; "
            f"pass --local-ranks {plan.world_size}")
    # Check the data and build any token cache here, once, before a rank starts (they map it).
    source = load_data(config, seq_len=plan.shared.seq_len, vocab_size=plan.shared.model.vocab_size)
    config, _ = with_epochs(config, source, sequences=plan.sequences_per_step)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"medley-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
        monitor_interval=0.1, start_method=start_method)
    # Rank 0 hosts each attempt's own store: with the agent's shared store, the ranks of a
    # restarted attempt found the dead attempt's gloo addresses there (connection refused).
    settings = {SHARED_STORE_ENV: "1", ONE_THREAD_ENV: "0" if start_method == "spawn" else "1",
                LAUNCHER_PID_ENV: str(os.getpid())}
    with _environment(settings), _agent_quiet(not debug_enabled()):
        try:
            results = elastic_launch(launch, rank_main)(plan, config, hooks)
        except ChildFailedError as err:
            if debug_enabled():
                raise
            raise RankFailure(failure_line(err)) from None
    failure = next((r for r in results.values() if isinstance(r, InputFailure)), None)
    if failure is not None:
        raise MedleyInputError(failure.message)
    return results[0]


def failure_line(err: ChildFailedError) -> str:
    """One line for torchelastic's failure report: a rank killed by a signal (the others then fail
    in their collectives, some of them sooner), else the first failed rank, and why."""
    killed = sorted(rank for rank, f in err.failures.items() if f.exitcode < 0)
    rank, failure = (killed[0], err.failures[killed[0]]) if killed else err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # an error file written by record_exception
        message = str(message.get("message", ""))
    if failure.error_file_data.get("errorTraits") or not message:  # exited without saying why
        message = f"exit code {failure.exitcode}"
    return (f"rank {rank} failed ({message.strip().splitlines()[0][:300]}); the other ranks were stopped; "
            "run again to resume from the newest checkpoint (--debug shows tracebacks and stacks)")


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    previous = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _agent_quiet(quiet: bool) -> Iterator[None]:
    """Mute torchelastic's logs (unless debugging) and give back the signal handlers its agent
    installs (it turns SIGINT and SIGTERM into its SignalException for good)."""
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    names = [name for name in logging.root.manager.loggerDict if name.startswith(_ELASTIC_LOGGERS)]
    levels = {name: logging.getLogger(name).level for name in names}
    if quiet:
        for name in names:  # torchelastic sets a level on each of its loggers
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for sig, handler in handlers.items():
            if handler is not None and threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler)
