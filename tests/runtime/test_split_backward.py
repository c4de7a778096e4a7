"""The split backward (B, then W) of a recomputing stage: same gradients as one backward, and each
checkpointed block reruns its forward once per backward call (as the simulator times it)."""

from __future__ import annotations

import torch

from medley.runtime.torch_adapter import backward_input, backward_weight
from medley.runtime.transformer import Block, Decoder
from medley.spec.model_arg import get_model

SPEC = get_model("tiny")


def _stage(recompute: bool) -> tuple[Decoder, list[int]]:
    module = Decoder(SPEC, first_layer=1, last_layer=5, recompute=recompute, seed=3)
    forwards = [0]
    for block in (m for m in module.modules() if isinstance(m, Block)):
        block.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    return module, forwards


def test_split_backward_of_recomputing_blocks_equals_one_backward_and_reruns_once() -> None:
    x = torch.randn(2, 16, SPEC.hidden_size, generator=torch.Generator().manual_seed(1))
    reference, _ = _stage(recompute=False)
    ref_in = x.clone().requires_grad_(True)
    out = reference(ref_in)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    torch.autograd.backward([out], [grad])

    stage, forwards = _stage(recompute=True)
    blocks = sum(1 for m in stage.modules() if isinstance(m, Block))
    inp = x.clone().requires_grad_(True)
    dinputs, saved = backward_input([stage(inp)], [grad], [inp], list(stage.parameters()))
    assert forwards[0] == 2 * blocks  # F, and the rerun inside B
    backward_weight(list(stage.parameters()), saved)
    assert forwards[0] == 3 * blocks  # one rerun for W, not one per parameter group
    torch.testing.assert_close(dinputs[0], ref_in.grad, rtol=0, atol=1e-6)
    for mine, theirs in zip(stage.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-6)
