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
from medley.runtime.torch_adapter import dynamo_supported, keep_backward_buffers
from medley.schedule.ir import Kind, PipelineSchedule


def apply_compile(module: nn.Module, *, split_backward: bool = False) -> int:
    """Compile every block of ``module`` (a :class:`medley.runtime.transformer.Decoder`) in place with
    ``torch.compile(fullgraph=True)``; returns how many blocks were compiled (0 for a stage of
    only the embedding or the head). ``split_backward``: the rank's program has B and W actions
    (zero-bubble schedules, :func:`splits_backward`); see :func:`compile_block`."""
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        raise TypeError(f"apply_compile needs a Decoder (with .blocks), got {type(module).__name__}")
    for block in blocks.values():
        compile_block(block, split_backward=split_backward)
    return len(blocks)


#: Inductor options of a block whose backward runs twice (B, then W reusing the graph): no
#: writing into a buffer the compiler thinks dead after one backward (the saved activations).
SPLIT_BACKWARD_OPTIONS = {"inplace_buffers": False, "allow_buffer_reuse": False}


def compile_block(block: nn.Module, *, split_backward: bool = False) -> None:
    """Compile one block in place, as the runtime does (``medley profile --compile`` times blocks
    compiled by this same call); dynamo traces it at its first call.

    ``split_backward``: the block's one compiled backward graph is run by B for the input gradient,
    keeping the autograd graph, and again by W for the weight gradients. AOTAutograd refuses that
    while it donates the backward's saved buffers, so donation is switched off for this process
    (``torch._functorch.config.donated_buffer``, read when the block is traced); and inductor's
    backward kernels still reused buffers in place: with that the run drifted from the reference
    after the first update (tiny model, pp 2 zb-h1: loss 1.7e-3 off at step 1 with AdamW; the
    ``aot_eager`` backend was equal), without it (:data:`SPLIT_BACKWARD_OPTIONS`) the run is equal.
    The backward graph then runs twice per micro-batch: B + W cost about two fused backwards, as
    ``medley profile --compile`` measures."""
    if split_backward:
        keep_backward_buffers()
        block.compile(fullgraph=True, options=dict(SPLIT_BACKWARD_OPTIONS))
    else:
        block.compile(fullgraph=True)


def splits_backward(schedule: PipelineSchedule, pipeline_rank: int) -> bool:
    """Whether ``pipeline_rank``'s program splits backward passes into B and W actions."""
    return any(action.kind is Kind.B for action in schedule.actions[pipeline_rank])


def check_compile_available() -> None:
    """``--compile`` needs torch's dynamo and, on CPU, a C++ compiler for inductor's kernels: refuse
    early (exit 2, one line) where either is missing."""
    import shutil

    if not dynamo_supported():
        raise MedleyInputError("--compile: torch.compile is not supported by this Python or torch build; "
                               "run without --compile")
    if not torch.cuda.is_available() and shutil.which("g++") is None and shutil.which("c++") is None:
        raise MedleyInputError("--compile: torch.compile on CPU needs a C++ compiler (g++) on PATH; "
                               "install one (apt-get install g++) or run without --compile")
