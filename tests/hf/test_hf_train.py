"""Training from Hugging Face weights and exporting back (gloo, CPU, ranks from the fork server):
a pp 2 x dp 2 ZeRO 3,1 run starts from the directory's weights (its first loss is transformers'
loss on the same batch, every loss the single-process reference's), and the export of its last
step is what the reference model computes; with --lr 0 the export is the input, bit for bit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_models import SEQ_LEN, hf_logits, hf_plan, transformers_loss
from safetensors import safe_open
from typer.testing import CliRunner

from medley.cli.main import app
from medley.hf.read import tensor_files
from medley.launch.spawn import train_local
from medley.runtime.checkpoint_layout import latest_checkpoint
from medley.runtime.hf_export import export_hf, read_model_tensors
from medley.runtime.reference import reference_losses, reference_train
from medley.runtime.train import TrainConfig, load_data
from medley.runtime.transformer import Decoder
from medley.spec.model_arg import get_model

TOL = 1e-5
SEED = 3


@pytest.mark.timeout(300)
def test_pp2_dp2_zero31_run_from_hf_weights_and_its_export(hf_models, tmp_path: Path) -> None:
    directory = hf_models["llama"]
    plan = hf_plan(directory, pp=2, dp=2, split="2,2", zero="3,1", micro_batches="2,2")
    config = TrainConfig.of(steps=3, seed=SEED, warmup_steps=1, lr=1e-2, min_lr=1e-3, clip_norm=1.0,
                         progress=False, measure_memory=False, init_from=directory, hf_dir=directory,
                         checkpoint_dir=tmp_path / "ckpt")
    records = train_local(plan, config)
    reference, want = reference_train(plan.layout, config)
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    batch = load_data(config, seq_len=SEQ_LEN, vocab_size=plan.layout.model.vocab_size).global_batch(
        step=0, seed=SEED, sequences=8, seq_len=SEQ_LEN)
    assert abs(records[0].loss - transformers_loss(directory, batch)) <= TOL
    assert records[2].loss < records[0].loss - 0.01, "the steps must change the weights"

    step = latest_checkpoint(tmp_path / "ckpt")
    out = export_hf(step, tmp_path / "export", max_shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    result = CliRunner().invoke(app, ["export", str(step), "--hf", str(tmp_path / "cli")])
    assert result.exit_code == 0 and (tmp_path / "cli" / "model.safetensors").is_file(), result.output
    one_file, shards = tensor_files(tmp_path / "cli"), tensor_files(out)
    assert set(one_file) == set(shards)
    for name in one_file:
        with safe_open(one_file[name], framework="pt") as a, safe_open(shards[name], framework="pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    tokens = batch[:2, :-1]
    spec, params, _ = read_model_tensors(latest_checkpoint(tmp_path / "ckpt"))
    trained = Decoder(spec, init=False)
    trained.load_state_dict(params)
    with torch.no_grad():
        theirs, ours, single = hf_logits(out, tokens), trained(tokens), reference(tokens)
    assert (theirs - ours).abs().max().item() <= TOL
    # The run's weights equal the reference's up to fp32 round-off of its sharded reductions.
    assert (theirs - single).abs().max().item() <= 10 * TOL


@pytest.mark.timeout(300)
def test_lr_zero_export_reproduces_the_weights_bit_for_bit(hf_models, tmp_path: Path) -> None:
    directory = hf_models["mistral"]
    out = tmp_path / "export"
    result = CliRunner().invoke(app, [
        "train", "--init-from", str(directory), "--local-ranks", "2", "--pp", "2", "--split", "2,3",
        "--zero", "2,0", "--micro-batches", "2", "--seq-len", "32", "--steps", "2", "--lr", "0",
        "--export-hf", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temporary checkpoints are removed"
    original, exported = tensor_files(directory), tensor_files(out)
    assert set(original) == set(exported)
    for name, file in original.items():
        with safe_open(file, framework="pt") as a, safe_open(exported[name], framework="pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert replace(get_model(str(out)), name="m") == replace(get_model(str(directory)), name="m")


def test_a_stage_reads_only_the_files_of_its_own_tensors(hf_models, monkeypatch: pytest.MonkeyPatch) -> None:
    from medley.hf import read as hf_read
    from medley.runtime import hf_weights
    from medley.runtime.transformer import Decoder

    directory = hf_models["llama"]  # saved in many shards
    spec = get_model(str(directory))
    opened: list[Path] = []
    real = hf_read.safe_open

    def spy(path, **kwargs):  # noqa: ANN001, ANN202
        opened.append(Path(path))
        return real(path, **kwargs)

    monkeypatch.setattr(hf_read, "safe_open", spy)
    files = tensor_files(directory)
    stage = Decoder(spec, first_layer=2, last_layer=spec.num_layers, init=False)  # block 1 and the head
    hf_weights.load_hf_weights(stage, directory)
    wanted = {files[n] for n in files if n.startswith(("model.layers.1.", "model.norm", "lm_head"))}
    assert set(opened) == wanted and len(opened) == len(wanted) < len(set(files.values()))


def test_reference_losses_start_from_the_same_weights(hf_models) -> None:
    directory = hf_models["qwen2"]  # tied embeddings and Q/K/V biases: one stage
    plan = hf_plan(directory, pp=1, dp=1, split="4", zero="0", micro_batches="2")
    config = TrainConfig.of(steps=1, seed=SEED, progress=False, init_from=directory)
    batch = load_data(config, seq_len=SEQ_LEN, vocab_size=plan.layout.model.vocab_size).global_batch(
        step=0, seed=SEED, sequences=4, seq_len=SEQ_LEN)
    assert abs(reference_losses(plan.layout, config)[0] - transformers_loss(directory, batch)) <= TOL


def test_text_data_is_tokenized_with_the_model_directorys_tokenizer(hf_models, bpe_tokenizer: Path) -> None:
    """--model DIR / --init-from DIR supply its tokenizer.json for text data (the shipped text
    included), as --tokenizer would; without one, text is bytes and needs a vocabulary of 256."""
    from medley.errors import MedleyInputError

    def first_batch(config: TrainConfig) -> torch.Tensor:
        source = load_data(config, seq_len=SEQ_LEN, vocab_size=257)
        return source.global_batch(step=0, seed=SEED, sequences=4, seq_len=SEQ_LEN)

    from_dir = first_batch(TrainConfig.of(hf_dir=hf_models["llama"]))
    assert torch.equal(from_dir, first_batch(TrainConfig.of(init_from=hf_models["llama"])))
    assert torch.equal(from_dir, first_batch(TrainConfig.of(tokenizer=str(bpe_tokenizer))))
    assert not torch.equal(from_dir, first_batch(TrainConfig.of()))  # bytes
    with pytest.raises(MedleyInputError, match="read as bytes .* vocab_size is 100"):
        load_data(TrainConfig.of(), seq_len=SEQ_LEN, vocab_size=100)
