"""Which AdamW implementation the runtime asks torch for: fused on CUDA, foreach elsewhere.

There is no GPU here: these check the arguments chosen for a CUDA device and that torch's AdamW
accepts and steps with them (torch has a fused CPU kernel too, which takes the same arguments);
the CUDA kernel itself runs only on a GPU (scripts/gpu-check.sh).
"""

from __future__ import annotations

import pytest
import torch

from medley.errors import MedleyInputError
from medley.runtime.optim import optimizer_class


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_adamw_is_fused_on_cuda(device: object) -> None:
    cls, kwargs = optimizer_class("adamw", lr=1e-3, weight_decay=0.1, device=device)
    assert cls is torch.optim.AdamW
    assert kwargs["fused"] is True and "foreach" not in kwargs


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_adamw_is_foreach_elsewhere(device: object) -> None:
    _, kwargs = optimizer_class("adamw", lr=1e-3, weight_decay=0.1, device=device)
    assert kwargs["foreach"] is True and "fused" not in kwargs


def test_the_default_device_is_cpu() -> None:
    assert optimizer_class("adamw", lr=1e-3, weight_decay=0.1)[1]["foreach"] is True


def test_sgd_is_foreach_everywhere() -> None:
    for device in ("cpu", "cuda"):
        cls, kwargs = optimizer_class("sgd", lr=1e-3, weight_decay=0.0, device=device)
        assert cls is torch.optim.SGD and kwargs["foreach"] is True and "fused" not in kwargs


def test_the_cuda_arguments_build_a_fused_adamw_that_steps_like_foreach() -> None:
    """The CUDA choice is a valid AdamW (torch refuses unknown or conflicting flags when it is
    built), and its update equals the foreach one (here on torch's CPU fused kernel)."""
    results = []
    for device in ("cuda", "cpu"):
        cls, kwargs = optimizer_class("adamw", lr=1e-2, weight_decay=0.1, device=device)
        gen = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(64, 32, generator=gen))
        optimizer = cls([param], **kwargs)
        assert bool(optimizer.defaults["fused"]) is (device == "cuda")
        for _ in range(3):
            param.grad = torch.randn(64, 32, generator=gen)
            optimizer.step()
        results.append(param.detach().clone())
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_an_unknown_optimizer_names_the_flag() -> None:
    with pytest.raises(MedleyInputError, match="--optimizer 'lion'"):
        optimizer_class("lion", lr=1e-3, weight_decay=0.1, device="cuda")
