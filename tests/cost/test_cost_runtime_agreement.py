"""The cost model's parameter counts must match the modules the runtime builds, layer by layer."""

import pytest

from medley.cost import formulas
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

SMALL_GPT = ModelSpec(
    name="small-gpt",
    vocab_size=96,
    hidden_size=32,
    num_blocks=2,
    num_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=128,
    mlp="gelu",
    norm="layernorm",
    position="learned",
    max_seq_len=16,
    tied_embeddings=True,
    bias=True,
)


@pytest.mark.parametrize("model", [get_model("tiny"), SMALL_GPT], ids=lambda m: m.name)
def test_layer_params_match_runtime_modules(model: ModelSpec):
    from medley.runtime.transformer import Decoder

    decoder = Decoder(model)
    for index, module in decoder.layer_modules().items():
        assert sum(p.numel() for p in module.parameters()) == formulas.layer_params(model, index), index
    assert sum(p.numel() for p in decoder.parameters()) == formulas.total_params(model)


@pytest.mark.parametrize("model", [get_model("tiny"), SMALL_GPT], ids=lambda m: m.name)
def test_autocast_keeps_copies_of_exactly_the_counted_weights(model: ModelSpec):
    """Each layer's forward under bf16 autocast on fp32 weights saves, for its backward, bf16
    copies of exactly formulas.layer_autocast_params of them (what a level-0 bf16 stage holds per
    micro-batch in flight beyond the pure-bf16 activations)."""
    import torch

    from medley.runtime.transformer import Decoder

    decoder = Decoder(model)
    x = torch.randint(0, model.vocab_size, (2, 8))
    weights = [p.detach().bfloat16() for p in decoder.parameters() if p.dim() == 2]

    def is_copy(t: torch.Tensor) -> bool:
        return t.dtype == torch.bfloat16 and t.dim() == 2 and any(
            (w.shape == t.shape and torch.equal(w, t)) or (w.shape == t.T.shape and torch.equal(w, t.T))
            for w in weights)

    for index, module in decoder.layer_modules().items():
        saved: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor, saved: dict = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t
            return t

        tied = decoder.embed.tok.weight if model.tied_embeddings else None
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, torch.autocast("cpu", torch.bfloat16):
            x = module(x, tied) if module is decoder.head else module(x)
        copies = sum(t.numel() for t in saved.values() if is_copy(t))
        assert copies == formulas.layer_autocast_params(model, index), index
        x = x.detach()
