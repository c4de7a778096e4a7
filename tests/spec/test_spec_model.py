import json
from pathlib import Path

import pytest

from medley.cost.formulas import total_params
from medley.errors import MedleyInputError
from medley.spec.model import PRESETS, ModelSpec
from medley.spec.model_arg import get_model

REQUIRED_PRESETS = [
    "tiny",
    "opt-350m",
    "gpt-neo-2.7b",
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "gpt-3-175b",
]


def test_all_presets_exist_and_layers_are_embedding_blocks_head():
    for name in REQUIRED_PRESETS:
        model = get_model(name)
        layers = model.layers()
        assert len(layers) == model.num_layers == model.num_blocks + 2
        assert [layer.index for layer in layers] == list(range(model.num_layers))
        assert layers[0].kind == "embedding" and layers[-1].kind == "head"
        assert {layer.kind for layer in layers[1:-1]} == {"block"}


def test_tiny_is_small():
    tiny = get_model("tiny")
    assert tiny.vocab_size == 256 and tiny.hidden_size <= 128 and tiny.num_kv_heads < tiny.num_heads
    assert total_params(tiny) < 1_000_000


def test_preset_lookup_is_case_insensitive():
    assert get_model("LLaMA-2-7B") is PRESETS["llama-2-7b"]


def test_zero_or_negative_sizes_are_rejected():
    with pytest.raises(MedleyInputError, match="hidden_size"):
        ModelSpec(
            name="x",
            vocab_size=10,
            hidden_size=0,
            num_blocks=1,
            num_heads=1,
            num_kv_heads=1,
            ffn_hidden_size=4,
            mlp="gelu",
            norm="layernorm",
            position="learned",
            max_seq_len=8,
            tied_embeddings=True,
            bias=True,
        )


def test_llama_config_json_matches_the_preset(tmp_path: Path):
    cfg = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = get_model(str(path))
    assert total_params(model) == total_params(get_model("llama-2-7b"))
    assert model.mlp == "swiglu" and model.position == "rope" and not model.tied_embeddings


def test_gpt2_and_opt_config_json(tmp_path: Path):
    gpt2 = {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
    }
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    model = get_model(str(tmp_path / "gpt2.json"))
    assert abs(total_params(model) - 124.4e6) / 124.4e6 < 0.01  # GPT-2 small: 124 M
    opt = {
        "model_type": "opt",
        "vocab_size": 50272,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "ffn_dim": 4096,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 512,
    }
    (tmp_path / "opt.json").write_text(json.dumps(opt))
    assert total_params(get_model(str(tmp_path / "opt.json"))) == total_params(get_model("opt-350m"))


def test_bad_config_json_is_an_input_error(tmp_path: Path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(MedleyInputError, match="malformed JSON"):
        get_model(str(tmp_path / "bad.json"))
    (tmp_path / "partial.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(MedleyInputError, match="hidden_size"):
        get_model(str(tmp_path / "partial.json"))
    with pytest.raises(MedleyInputError, match="preset"):
        get_model("llama-9-1b")
