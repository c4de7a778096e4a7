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
    from medley.runtime.model import Decoder

    decoder = Decoder(model)
    for index, module in decoder.layer_modules().items():
        assert sum(p.numel() for p in module.parameters()) == formulas.layer_params(model, index), index
    assert sum(p.numel() for p in decoder.parameters()) == formulas.total_params(model)
