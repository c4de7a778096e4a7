"""A tied Qwen2 model trained on two pipeline stages from its Hugging Face weights (``medley train
--init-from``): the losses are the single-process reference's, the export holds the tied weight
once (``tie_word_embeddings``), and transformers computes from it what medley computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import hf_logits
from test_hf_train import SEED, SEQ_LEN, TOL, hf_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.hf.read import tensor_files
from medley.runtime.checkpoint_layout import latest_checkpoint
from medley.runtime.hf_export import read_model_tensors
from medley.runtime.reference import reference_train
from medley.runtime.train import TrainConfig, load_data
from medley.runtime.transformer import Decoder


@pytest.mark.timeout(300)
def test_tied_qwen2_on_two_stages_from_hf_weights_and_its_export(hf_models, tmp_path: Path) -> None:
    directory = hf_models["qwen2"]
    out, ckpt = tmp_path / "export", tmp_path / "ckpt"
    result = CliRunner().invoke(app, [
        "train", "--init-from", str(directory), "--local-ranks", "2", "--pp", "2", "--split", "2,2",
        "--zero", "0,0", "--micro-batches", "2", "--micro-batch-size", "2", "--seq-len", str(SEQ_LEN),
        "--steps", "3", "--seed", str(SEED), "--lr", "1e-2", "--min-lr", "1e-3", "--warmup-steps", "1",
        "--clip-norm", "1.0", "--checkpoint-dir", str(ckpt), "--export-hf", str(out), "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["records"]
    plan = hf_plan(directory, pp=2, dp=1, split="2,2", zero="0,0", micro_batches="2")
    config = TrainConfig.of(steps=3, seed=SEED, warmup_steps=1, lr=1e-2, min_lr=1e-3, clip_norm=1.0,
                         progress=False, init_from=directory, hf_dir=directory)
    reference, want = reference_train(plan.layout, config)
    assert max(abs(r["loss"] - w) for r, w in zip(records, want, strict=True)) <= TOL
    assert records[2]["loss"] < records[0]["loss"] - 0.01, "the steps must change the weights"

    names = set(tensor_files(out))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    spec, params, _ = read_model_tensors(latest_checkpoint(ckpt))
    assert "head.out.weight" not in params
    trained = Decoder(spec, init=False)
    trained.load_state_dict(params)
    batch = load_data(config, seq_len=SEQ_LEN, vocab_size=spec.vocab_size).global_batch(
        step=0, seed=SEED, sequences=4, seq_len=SEQ_LEN)
    tokens = batch[:2, :-1]
    with torch.no_grad():
        theirs, ours, single = hf_logits(out, tokens), trained(tokens), reference(tokens)
    assert (theirs - ours).abs().max().item() <= TOL
    assert (theirs - single).abs().max().item() <= 10 * TOL
