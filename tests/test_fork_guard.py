"""The suite's fork guard (tests/conftest.py) refuses a fork of the pytest process."""

from __future__ import annotations

import os

import pytest
import torch


def test_forking_pytest_after_torch_fails_fast() -> None:
    torch.ones(2).sum()  # the process has run a torch op
    # os.fork is what every fork start method calls; the guard raises before any child exists.
    with pytest.raises(RuntimeError, match="forked the pytest process"):
        os.fork()
