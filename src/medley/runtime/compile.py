"""``torch.compile`` of a stage's blocks (``medley train --compile``), as torchtitan's
``apply_compile``: each transformer block is compiled on its own, ``fullgraph=True``, in place
(``nn.Module.compile``: parameter names and the module tree stay as they are, so checkpoints,
the equality tests' name maps and FSDP2's units see the same modules).

Order, as in torchtitan: after tensor parallelism (the compiled graph holds its DTensor
redistributions) and activation checkpointing (a recomputing stage checkpoints the compiled
block, whose recompute is the compiled forward), before ZeRO sharding (FSDP2's hooks stay outside
the graph: dynamo skips them, ``torch._dynamo.config.skip_fsdp_hooks``). The embedding and the
head stay eager: one each per model, and the head's vocabulary-wide matmul is no fusion target.

Every block of a model has the same code and shapes, so dynamo traces once and the other blocks
reuse the graph (guards on the module's identity aside): compile time grows with the number of
distinct block shapes, not of blocks. The first step pays it; ``medley profile --compile`` times
compiled blocks after their warm-up (:mod:`medley.profile.layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from medley.errors import MedleyInputError
from medley.schedule.ir import Kind, PipelineSchedule


def apply_compile(module: nn.Module, *, split_backward: bool = False, family: str = "") -> int:
    """Compile every block of ``module`` (a :class:`medley.runtime.model.Decoder`) in place with
    ``torch.compile(fullgraph=True)``; returns how many blocks were compiled (0 for a stage of
    only the embedding or the head).

    ``split_backward`` (the rank's program has B actions: the zero-bubble schedules, see
    :func:`splits_backward`) is refused, naming the schedule ``family``: a compiled block's
    backward is one graph, which B would run for the input gradient keeping the graph and W again
    for the weight gradients. With AOTAutograd's buffer donation off that runs, and each
    micro-batch's gradients equal eager's, but a run through ``medley train`` drifted from the
    reference after the first update (loss 1.7e-3 off at step 1 with AdamW, 2.6e-4 with SGD),
    which is not understood yet: not done."""
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        raise TypeError(f"apply_compile needs a Decoder (with .blocks), got {type(module).__name__}")
    if split_backward:
        raise MedleyInputError(
            f"--compile: schedule '{family}' splits each backward into B and W actions, which the runtime "
            "does not run on compiled blocks; use 1f1b, gpipe or interleaved, or drop --compile")
    for block in blocks.values():
        compile_block(block)
    return len(blocks)


def compile_block(block: nn.Module) -> None:
    """Compile one block in place, as the runtime does (``medley profile --compile`` times blocks
    compiled by this same call); dynamo traces it at its first call."""
    block.compile(fullgraph=True)


def splits_backward(schedule: PipelineSchedule, pipeline_rank: int) -> bool:
    """Whether ``pipeline_rank``'s program splits backward passes into B and W actions."""
    return any(action.kind is Kind.B for action in schedule.actions[pipeline_rank])


def check_compile_available() -> None:
    """``--compile`` needs torch's dynamo and, on CPU, a C++ compiler for inductor's kernels: refuse
    early (exit 2, one line) where either is missing."""
    import shutil

    from torch._dynamo import is_dynamo_supported

    if not is_dynamo_supported():
        raise MedleyInputError("--compile: torch.compile is not supported by this Python or torch build; "
                               "run without --compile")
    if not torch.cuda.is_available() and shutil.which("g++") is None and shutil.which("c++") is None:
        raise MedleyInputError("--compile: torch.compile on CPU needs a C++ compiler (g++) on PATH; "
                               "install one (apt-get install g++) or run without --compile")
