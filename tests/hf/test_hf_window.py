"""Sliding-window attention (Mistral, Qwen2 with every layer windowed) on sequences longer than the
window: medley's logits are transformers' (and a window one token off is not), a pp 2 run from the
weights is the single-process reference, and a Qwen2 config windowing only some layers is refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_models import SEQ_LEN, hf_logits, hf_plan, transformers_loss
from typer.testing import CliRunner

from medley.cli.main import app
from medley.launch.spawn import train_local
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.reference import reference_losses
from medley.runtime.setup import check_plan
from medley.runtime.train import TrainConfig, load_data
from medley.runtime.transformer import Attention, Decoder
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

TOL = 1e-5


def medley_logits(spec: ModelSpec, directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = Decoder(spec, init=False)
    load_hf_weights(model, directory)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("family", ["mistral_w8", "qwen2_w8"])
def test_windowed_logits_equal_transformers(hf_models, family: str) -> None:
    directory = hf_models[family]
    spec = get_model(str(directory))
    assert spec.sliding_window == 8
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    want = hf_logits(directory, tokens)
    assert (medley_logits(spec, directory, tokens) - want).abs().max().item() <= TOL
    for off_by_one in (7, 9):
        other = medley_logits(replace(spec, sliding_window=off_by_one), directory, tokens)
        assert (other - want).abs().max().item() > 1e-3, f"a window of {off_by_one} must differ"


def test_window_mask_is_causal_and_window_wide() -> None:
    mask = Attention.window_mask(5, 2, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0],
                                   [0, 0, 0, 1, 1]]


@pytest.mark.timeout(300)
def test_pp2_windowed_run_equals_the_reference(hf_models) -> None:
    directory = hf_models["qwen2_w8"]  # the window, Q/K/V biases, untied: two stages
    plan = hf_plan(directory, pp=2, dp=1, split="2,2", zero="0", micro_batches="2")
    check_plan(plan, 2)  # what plan emits for a window shorter than --seq-len, train runs
    config = TrainConfig.of(steps=2, seed=3, lr=1e-2, progress=False, measure_memory=False,
                            init_from=directory)
    records = train_local(plan, config)
    want = reference_losses(plan.layout, config)
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    batch = load_data(config, seq_len=SEQ_LEN, vocab_size=plan.layout.model.vocab_size).global_batch(
        step=0, seed=3, sequences=4, seq_len=SEQ_LEN)
    assert abs(records[0].loss - transformers_loss(directory, batch)) <= TOL


def test_qwen2_windowing_only_some_layers_is_refused(hf_models, tmp_path: Path) -> None:
    shutil.copytree(hf_models["qwen2_w8"], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(max_window_layers=1, layer_types=None)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(app, ["model", "show", str(tmp_path / "m" / "config.json")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "field 'max_window_layers': windows 1 of 2 layers" in lines[0]
    cfg.update(use_sliding_window=False)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert get_model(str(tmp_path / "m")).sliding_window is None
