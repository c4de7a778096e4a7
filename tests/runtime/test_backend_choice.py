"""The process group's backend, chosen in one place (:func:`medley.launch.spawn.init_process_group`)
for torchrun runs and elastic rounds alike: nccl where every local rank has a GPU, gloo with
``--device cpu`` whatever the machine has (an elastic round picked nccl on a GPU node before,
because it did not pass ``--device cpu`` on)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from medley.launch import spawn as launch
from medley.runtime.train import TrainConfig


@pytest.mark.parametrize(("device", "gpus", "want"), [("auto", True, "nccl"), ("cpu", True, "gloo"),
                                                     ("auto", False, "gloo"), ("cpu", False, "gloo")])
def test_backend_follows_the_device_setting(monkeypatch: pytest.MonkeyPatch, device: str, gpus: bool,
                                            want: str) -> None:
    started: list[tuple[str, float]] = []
    monkeypatch.setattr(launch, "uses_cuda", lambda local_world: gpus)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, *, timeout, **_: started.append((backend, timeout.total_seconds())))
    config = TrainConfig.of(device=device)
    assert launch.init_process_group(config) == want
    assert started[0][0] == want
    assert started[0][1] > config.logging.first_step_timeout_s  # the watchdog names a hang first
