"""Rank body of the TP bytes test: the all-reduces one forward and one backward of a tp2 stage
of blocks issue, counted as torch's functional collectives (``torch.ops._c10d_functional``, what
``parallelize_module``'s DTensors call; the ``torch.distributed`` wrappers of the ZeRO bytes test
never see them) under a dispatch mode."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from equality_worker import MBS, SEED, SEQ, Case
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from medley.runtime.model import Decoder
from medley.runtime.tensor_parallel import TP_DIM, parallelize_blocks
from medley.spec.model_arg import get_model

FIRST_BLOCK = 1  # layer index of the first block (0 is the embedding)


class CountAllReduces(TorchDispatchMode):
    """Calls and input bytes of every functional all-reduce issued while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.nbytes, self.other = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        if name.startswith("_c10d_functional.all_reduce"):
            self.calls += 1
            self.nbytes += args[0].numel() * args[0].element_size()
        elif name.startswith("_c10d_functional.") and "wait_tensor" not in name:
            self.other.add(name)
        return func(*args, **(kwargs or {}))


def count_tp_bytes(case: Case) -> dict[str, Any]:
    """Build ``case.split[0]`` blocks of tiny, shard them over all ranks (one TP group), run one
    forward and one backward of a micro-batch, and report each pass's all-reduce calls and bytes."""
    spec = get_model("tiny")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(TP_DIM,))
    stage = Decoder(spec, first_layer=FIRST_BLOCK, last_layer=FIRST_BLOCK + case.split[0], seed=SEED)
    parallelize_blocks(stage, mesh)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(MBS, SEQ, spec.hidden_size, generator=gen, requires_grad=True)
    grad = torch.randn(MBS, SEQ, spec.hidden_size, generator=gen)
    out: dict[str, Any] = {}
    forward = CountAllReduces()
    with forward:
        y = stage(x)
    backward = CountAllReduces()
    with backward:
        y.backward(grad)
    for kind, mode in (("F", forward), ("B", backward)):
        out[f"{kind}.calls"], out[f"{kind}.bytes"] = float(mode.calls), float(mode.nbytes)
        out[f"{kind}.other"] = ",".join(sorted(mode.other))
    return out
