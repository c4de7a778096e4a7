"""Real measurements on the tiny model: what each figure must look like, and `medley profile`."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.profile_format import load_profile
from medley.profile.layers import measure_layer
from medley.spec.model_arg import get_model

TINY = get_model("tiny")


def test_layer_figures_follow_the_runtime_split() -> None:
    embedding = measure_layer(TINY, "embedding", micro_batch_size=2, seq_len=32, runs=2, warmup=1)
    block = measure_layer(TINY, "block", micro_batch_size=2, seq_len=32, runs=2, warmup=1)
    head = measure_layer(TINY, "head", micro_batch_size=2, seq_len=32, runs=2, warmup=1)
    # Token ids take no gradient: the embedding's whole backward happens at W, and it holds its
    # output until then.
    assert embedding.backward_input_s < embedding.backward_weight_s
    assert embedding.activation_after_b_bytes == embedding.activation_bytes
    for m in (block, head):
        assert min(m.forward_s, m.backward_input_s, m.backward_weight_s, m.backward_full_s) > 0
        # B keeps the graph (retain_graph) plus the intermediates' gradients for W.
        assert m.activation_after_b_bytes >= m.activation_bytes > 0
        assert m.backward_workspace_bytes > 0
    # A block saves at least its SwiGLU's inner tensors and Q/K/V for backward (fp32).
    tokens = 2 * 32
    assert block.activation_bytes > tokens * (3 * TINY.ffn_hidden_size + 2 * TINY.kv_dim) * 4


def test_profile_command_writes_a_loadable_file(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    args = ["profile", "--model", "tiny", "--micro-batch-sizes", "1,2", "--seq-len", "16", "--runs", "1",
            "--no-overhead", "--comm-ranks", "0", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.device_type == "CPU-8GB" and profile.torch_version.startswith("2.13")
    assert {(m.kind, m.micro_batch_size) for m in profile.layers} == {
        (k, b) for k in ("embedding", "block", "head") for b in (1, 2)}
    assert profile.comm is None and profile.optimizer is not None and profile.optimizer.per_param_s > 0
    assert json.loads(result.output)["host"] == profile.host
    bad = CliRunner().invoke(app, ["profile", "--model", "tiny", "--device", "tpu", "--out", str(out)])
    assert bad.exit_code == 2 and "--device 'tpu' must be cpu or cuda" in bad.output


def test_fidelity_command_rejects_unknown_cases(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["fidelity", "--cases", "nope", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--cases: unknown ['nope']" in result.output
    assert not list(tmp_path.iterdir())  # nothing profiled or run


def test_activation_bytes_are_the_saved_tensors_and_the_output_exactly() -> None:
    """On CPU a layer's activation bytes are the exact storage bytes its forward leaves alive, as
    the runtime's memory probe counts them: what autograd saved for the backward (not the weights
    nor the input) plus the output, with no allocator rounding."""
    import torch

    from medley.profile.layer_build import build_layer, layer_inputs

    block = measure_layer(TINY, "block", micro_batch_size=2, seq_len=32, runs=1, warmup=0)
    layer = build_layer(TINY, "block", torch.float32, torch.device("cpu"))
    x, targets = layer_inputs(TINY, "block", 2, 32, torch.float32, torch.device("cpu"))
    inp = x.detach().requires_grad_(True)
    owned = {t.untyped_storage().data_ptr() for t in (*layer.module.parameters(), inp)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in owned:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer.forward(inp, targets)
    output = out.untyped_storage().nbytes() if out.untyped_storage().data_ptr() not in saved else 0
    assert block.activation_bytes == sum(saved.values()) + output
