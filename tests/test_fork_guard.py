"""The suite's fork guard (tests/conftest.py) refuses a fork of the pytest process."""

from __future__ import annotations

import multiprocessing

import pytest
import torch


def _noop() -> None:
    pass


def test_forking_pytest_after_torch_fails_fast() -> None:
    torch.ones(2).sum()  # the process has run a torch op
    process = multiprocessing.get_context("fork").Process(target=_noop)
    with pytest.raises(RuntimeError, match="forked the pytest process"):
        process.start()
