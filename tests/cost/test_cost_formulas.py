import pytest

from medley.cost import formulas
from medley.cost.interfaces import Pass
from medley.spec.model import PRESETS
from medley.spec.model_arg import get_model

PUBLISHED_PARAMS = {
    "llama-2-7b": 6.74e9,
    "llama-2-70b": 68.98e9,
    "llama-3-8b": 8.03e9,
    "gpt-3-175b": 174.6e9,
    "opt-350m": 331e6,
    "llama-2-13b": 13.0e9,
    "llama-3-70b": 70.6e9,
    "gpt-neo-2.7b": 2.7e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_param_counts_within_one_percent(name: str):
    count = formulas.total_params(get_model(name))
    tolerance = 0.02 if name == "gpt-neo-2.7b" else 0.01  # "2.7B" is a rounded 2.65 B
    assert abs(count - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name] < tolerance


def test_tied_head_owns_no_weight_but_holds_a_copy():
    model = get_model("gpt-3-175b")
    head = model.num_layers - 1
    assert formulas.layer_params(model, head) == 2 * model.hidden_size  # final layernorm only
    assert (
        formulas.layer_held_params(model, head)
        == 2 * model.hidden_size + model.vocab_size * model.hidden_size
    )


@pytest.mark.parametrize("name", sorted(set(PRESETS) - {"opt-350m"}))
@pytest.mark.parametrize("seq_len", [128, 2048])
def test_flops_per_step_match_megatron_within_two_percent(name: str, seq_len: int):
    model = get_model(name)
    ours = sum(
        formulas.layer_flops(model, i, p, micro_batch_size=2, seq_len=seq_len)
        for i in range(model.num_layers)
        for p in Pass
    )
    megatron = formulas.megatron_flops_per_step(model, batch_size=2, seq_len=seq_len)
    assert abs(ours - megatron) / megatron < 0.02


def test_opt_350m_flops_match_megatron_once_its_narrow_head_is_accounted_for():
    # Megatron's formula assumes an h-wide LM head; OPT-350M's head is 512 wide behind two projections.
    model = get_model("opt-350m")
    b, s, h, e, v = 1, 2048, model.hidden_size, model.embed_dim, model.vocab_size
    ours = sum(
        formulas.layer_flops(model, i, p, micro_batch_size=b, seq_len=s)
        for i in range(model.num_layers)
        for p in Pass
    )
    megatron = formulas.megatron_flops_per_step(model, batch_size=b, seq_len=s)
    adjusted = megatron - 6 * b * s * h * v + 6 * b * s * e * v + 2 * 6 * b * s * h * e
    assert abs(ours - adjusted) / adjusted < 0.02


def test_f_b_w_split_linear_equal_attention_core_in_b():
    model = get_model("llama-2-7b")
    kw = {"micro_batch_size": 1, "seq_len": 4096}
    f, b, w = (formulas.layer_flops(model, 1, p, **kw) for p in Pass)
    core = formulas.attention_core_flops(model, **kw)
    assert f - core == pytest.approx(w)
    assert b == pytest.approx(w + 2 * core)
    head = model.num_layers - 1
    assert formulas.layer_flops(model, head, Pass.F, **kw) == 2 * 4096 * model.hidden_size * model.vocab_size


def test_six_n_per_token_is_the_leading_term():
    model = get_model("llama-2-70b")
    tokens = 4 * 512
    total = sum(
        formulas.layer_flops(model, i, p, micro_batch_size=4, seq_len=512)
        for i in range(model.num_layers)
        for p in Pass
    )
    six_n = 6 * formulas.total_params(model) * tokens
    assert 1.0 < total / six_n < 1.05  # attention scores add a few percent at s=512


def test_activation_bytes_match_a_hand_count_and_recompute_keeps_only_the_input():
    model = get_model("llama-2-7b")
    b, s, h, ffn = 2, 1024, 4096, 11008
    held = formulas.layer_activation_bytes(model, 5, micro_batch_size=b, seq_len=s)
    # input, attn-norm out, Q K V, attention out (the kernel's and the copy wo reads), mlp-norm in
    # and out, gate, its SiLU, up, product (bf16), attention's log-sum-exp (fp32)
    by_hand = b * s * (h + h + 3 * h + 2 * h + h + h + 4 * ffn) * 2 + b * model.num_heads * s * 4
    assert held == by_hand
    assert (
        formulas.layer_activation_bytes(model, 5, micro_batch_size=b, seq_len=s, recompute=True)
        == b * s * h * 2
    )
    after_b = formulas.layer_activation_bytes_after_b(model, 5, micro_batch_size=b, seq_len=s)
    assert 0 < after_b
    assert formulas.boundary_bytes(model, micro_batch_size=b, seq_len=s) == b * s * h * 2


def test_activation_bytes_scale_linearly_with_micro_batch():
    model = get_model("gpt-3-175b")
    one = formulas.layer_activation_bytes(model, 3, micro_batch_size=1, seq_len=2048)
    four = formulas.layer_activation_bytes(model, 3, micro_batch_size=4, seq_len=2048)
    assert four == pytest.approx(4 * one)
    # Same order as Korthikanti's 34·sbh without dropout masks and with flash attention.
    assert 15 < one / (2048 * model.hidden_size) < 40


def test_an_explicit_head_width_and_qkv_biases_change_the_attention_matmuls():
    import dataclasses

    base = get_model("tiny")  # h 64, 4 heads (16 wide), 2 KV heads
    wide = dataclasses.replace(base, explicit_head_dim=32, qkv_bias=True)
    qkv, out = formulas.layer_gemms(wide, 1, micro_batch_size=1, seq_len=8)[:2]
    assert (qkv.in_features, qkv.out_features) == (64, 4 * 32 + 2 * 2 * 32)
    assert (out.in_features, out.out_features) == (128, 64)
    added = (64 * 256 + 128 * 64 + 256) - (64 * 128 + 64 * 64)  # wider Q/K/V/O, and Q/K/V biases
    assert formulas.layer_params(wide, 1) - formulas.layer_params(base, 1) == added
    assert formulas.attention_core_flops(wide, micro_batch_size=1, seq_len=8) == 4.0 * 8 * 8 * 128


def test_a_tied_stage_holds_the_copy_only_without_the_embedding():
    """The runtime's last stage keeps a copy of a tied embedding; one stage holding both ends does not."""
    model = get_model("gpt-3-175b")
    copy, last = model.vocab_size * model.embed_dim, model.num_layers
    assert formulas.stage_held_params(model, 0, last) == formulas.total_params(model)
    assert formulas.stage_held_params(model, last - 2, last) == (
        formulas.layer_params(model, last - 2) + formulas.layer_params(model, last - 1) + copy)
    first_two = formulas.layer_params(model, 0) + formulas.layer_params(model, 1)
    assert formulas.stage_held_params(model, 0, 2) == first_two
