"""Suite-wide guards: no test may fork the pytest process once torch is imported, and no test
sees a debug switch another test left on.

A forked child inherits torch's intra-op thread pool without its threads and can block forever on
it (the equality tests hung this way at random on clean clones). Ranks come from a fork server or
spawn instead; ``subprocess`` (fork + exec) is unaffected. This makes a fork fail at once, in the
test that did it, instead of hanging minutes later.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

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
