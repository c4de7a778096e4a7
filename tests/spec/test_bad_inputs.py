"""Issue #11: inputs that were silently wrong or ran unbounded are refused with one line naming the
file (or flag), the field, the limit or the fix."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.formulas import total_params
from medley.errors import MedleyInputError
from medley.spec.cluster_load import load_cluster, parse_cluster_arg
from medley.spec.model_arg import get_model

WIDE = {"COLUMNS": "1000"}  # rich must not wrap the one-line errors

LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner(env=WIDE).invoke(app, list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.stderr.strip()


def write_json(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def write_cluster(tmp_path: Path, node: str, tiers: str = "") -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(f'[[nodes]]\nname = "n"\ndevice = "A100-80GB"\n{node}\n{tiers}')
    return path


# --- 6: unbounded sizes --------------------------------------------------------------------------


def test_a_huge_short_form_is_refused_before_any_device_is_built():
    start = time.monotonic()
    code, err = cli("cluster", "show", "99999999999999999999xA100-80GB")
    assert code == 2 and "limit is 65,536 devices per cluster" in err and "\n" not in err
    assert time.monotonic() - start < 5


def test_the_device_limit_is_exact():
    assert parse_cluster_arg("65536xA100-80GB").num_devices == 65536
    with pytest.raises(MedleyInputError, match="65,536"):
        parse_cluster_arg("65000xA100-80GB+537xT4-16GB")


def test_repeat_ten_million_is_refused(tmp_path: Path):
    path = write_cluster(tmp_path, "count = 8\nrepeat = 10000000",
                         '[[tiers]]\nname = "net"\nbandwidth_gbps = 10\n')
    start = time.monotonic()
    code, err = cli("cluster", "show", str(path))
    assert code == 2 and "nodes[0].repeat" in err and "<= 65536" in err and "\n" not in err
    assert time.monotonic() - start < 5


def test_repeats_are_bounded_in_total(tmp_path: Path):
    tiers = '[[tiers]]\nname = "net"\nbandwidth_gbps = 10\n'
    path = write_cluster(tmp_path, "count = 8\nrepeat = 8193", tiers)
    with pytest.raises(MedleyInputError, match=r"65,544 devices; the limit is 65,536"):
        load_cluster(path)


# --- 9: no coercion, finite numbers, hints that match the constraint ---------------------------


@pytest.mark.parametrize("value", ["true", '"4"', "4.0"])
def test_count_must_be_a_whole_number(tmp_path: Path, value: str):
    with pytest.raises(MedleyInputError, match=r"nodes\[0\]\.count.*valid integer; fix: write a whole"):
        load_cluster(write_cluster(tmp_path, f"count = {value}"))


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_tflops_must_be_finite(tmp_path: Path, value: str):
    with pytest.raises(MedleyInputError, match=r"nodes\[0\]\.tflops.*finite"):
        load_cluster(write_cluster(tmp_path, f"count = 1\ntflops = {value}"))


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [("count", "0", "use a number > 0"), ("price_per_hour", "-1", "use a number >= 0"),
     ("repeat", "70000", "use a number <= 65536")],
)
def test_hints_follow_the_constraint(tmp_path: Path, field: str, value: str, fix: str):
    node = f"{field} = {value}" if field == "count" else f"count = 1\n{field} = {value}"
    with pytest.raises(MedleyInputError) as info:
        load_cluster(write_cluster(tmp_path, node))
    assert f"fix: {fix}." in str(info.value) and "\n" not in str(info.value)


def test_several_problems_are_one_line(tmp_path: Path):
    with pytest.raises(MedleyInputError) as info:
        load_cluster(write_cluster(tmp_path, 'count = "4"\ntflops = inf\nmemory_gb = true'))
    assert "\n" not in str(info.value) and "(2 more problems)" in str(info.value)


def test_a_key_with_a_newline_stays_on_one_line(tmp_path: Path):
    with pytest.raises(MedleyInputError) as info:
        load_cluster(write_cluster(tmp_path, 'count = 1\n"a\\nb" = 1'))
    assert "\n" not in str(info.value) and "a\\nb" in str(info.value)


# --- 9: Hugging Face configs ---------------------------------------------------------------------


def test_llama_without_hidden_act_is_swiglu_as_in_transformers(tmp_path: Path):
    model = get_model(write_json(tmp_path, LLAMA_2_7B))
    assert model.mlp == "swiglu"
    assert abs(total_params(model) - 6.74e9) / 6.74e9 < 0.01
    assert model.norm_eps == 1e-5


def test_llama_defaults_follow_transformers(tmp_path: Path):
    cfg = {k: v for k, v in LLAMA_2_7B.items() if k not in ("rms_norm_eps", "tie_word_embeddings")}
    model = get_model(write_json(tmp_path, cfg))
    assert model.norm_eps == 1e-6 and not model.tied_embeddings and model.rope_theta == 10000.0


def test_mixtral_is_refused_naming_the_moe_field(tmp_path: Path):
    code, err = cli("model", "show", write_json(tmp_path, MIXTRAL_8X7B))
    assert code == 2 and "num_local_experts" in err and "mixture-of-experts" in err and "\n" not in err


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "qwen3_next"}, "model_type"),
        ({"model_type": None}, "model_type"),
        ({"num_experts": 64}, "num_experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"head_dim": 0}, "explicit_head_dim"),
        ({"attention_bias": True}, "attention_bias"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"num_hidden_layers": 100000}, "num_blocks"),
        ({"hidden_size": True}, "hidden_size"),
    ],
)
def test_unsupported_hf_fields_are_refused(tmp_path: Path, change: dict, field: str):
    cfg = {**LLAMA_2_7B, "max_position_embeddings": 32768, **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(MedleyInputError, match=field) as info:
        get_model(write_json(tmp_path, cfg))
    assert "\n" not in str(info.value)


def test_mistral_without_a_window_is_read(tmp_path: Path):
    cfg = {**LLAMA_2_7B, "model_type": "mistral", "sliding_window": None, "num_key_value_heads": 8}
    model = get_model(write_json(tmp_path, cfg))
    assert model.mlp == "swiglu" and model.num_kv_heads == 8
