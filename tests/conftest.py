"""Suite-wide guards: no test may fork the pytest process once torch is imported, and no test
sees a debug switch another test left on. Also the suite's small BPE tokenizers (trained on the
shipped corpus), shared by the data and the Hugging Face tests.

A forked child inherits torch's intra-op thread pool without its threads and can block forever on
it (the equality tests hung this way at random on clean clones). Ranks come from a fork server or
spawn instead; ``subprocess`` (fork + exec) is unaffected. This makes a fork fail at once, in the
test that did it, instead of hanging minutes later.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from medley.data.bpe import train_bpe
from medley.schedule.ir import Action, Kind, PipelineSchedule, add_send_recv

_real_fork: Callable[[], int] = os.fork


def _guarded_fork() -> int:
    if "torch" in sys.modules:
        raise RuntimeError(
            "a test forked the pytest process after torch was imported; forked children deadlock on "
            "torch's inherited thread pool: start ranks with start_method='forkserver' or 'spawn'")
    return _real_fork()


@pytest.fixture(autouse=True, scope="session")
def _no_fork_after_torch() -> Iterator[None]:
    os.fork = _guarded_fork
    try:
        yield
    finally:
        os.fork = _real_fork


@pytest.fixture(autouse=True)
def _debug_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`medley --debug` sets MEDLEY_DEBUG in the process it runs in (so that ranks inherit it); a
    CliRunner test that passes --debug would otherwise leave it on for every later test."""
    from medley.errors import DEBUG_ENV

    monkeypatch.delenv(DEBUG_ENV, raising=False)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Token caches (``$XDG_CACHE_HOME/medley``) go to a temporary folder, for the test process
    and every command it starts, never to the user's cache."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json of 256 tokens or fewer: it fits the tiny model's vocabulary."""
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", 256)


@pytest.fixture(scope="session")
def large_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json of more than 256 tokens: too many for the tiny model."""
    return train_bpe(tmp_path_factory.mktemp("bpe_large") / "tokenizer.json", 400)


def _receive_before_consumer(schedule: PipelineSchedule) -> PipelineSchedule:
    """``schedule`` lowered as medley lowered it while gloo told messages apart by tag: each RECV
    right before the compute action that uses it."""
    lowered = add_send_recv(schedule)
    rows = []
    for row in lowered.actions:
        out = [a for a in row if a.kind not in (Kind.RECV_F, Kind.RECV_B)]
        for recv in (a for a in row if a.kind in (Kind.RECV_F, Kind.RECV_B)):
            if recv.kind is Kind.RECV_F:
                consumer = Action(recv.stage, Kind.F, recv.micro_batch)
            else:
                consumer = next(a for a in out if a.stage == recv.stage and a.micro_batch == recv.micro_batch
                                and a.kind in (Kind.B, Kind.BW))
            out.insert(out.index(consumer), recv)
        rows.append(out)
    return lowered.with_actions(rows)


@pytest.fixture
def former_lowering() -> Callable[[PipelineSchedule], PipelineSchedule]:
    """The lowering of before NCCL's message order (receives right before their consumers)."""
    return _receive_before_consumer
