"""LoRA against PEFT (peft as a test dependency): from the same Hugging Face weights, adapter
initialisation and data, medley's single-process LoRA run gives PEFT's losses and adapter weights
(fp32, 1e-5); a pp 2 x dp 2 ZeRO 3 LoRA run gives the reference's, and its export loads with
``PeftModel.from_pretrained`` (and, merged, with transformers alone) to the trained model's logits."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from hf_models import SEQ_LEN, hf_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.hf.names import peft_name
from medley.launch.spawn import train_local
from medley.runtime.checkpoint_layout import latest_checkpoint
from medley.runtime.materialize import init_local_shards
from medley.runtime.optim import LrSchedule, optimizer_class, set_lr
from medley.runtime.reference import reference_run
from medley.runtime.train import TrainConfig, load_data
from medley.runtime.transformer import Decoder, token_loss_sum
from medley.spec.adapter import HF_NAMES, LoraSpec

TOL = 1e-5
SEED = 5
LORA = LoraSpec(rank=4, alpha=8.0, targets=("wq", "wk", "wv", "wo", "gate", "up", "down"))


def _settings(directory: Path, **more: object) -> TrainConfig:
    return TrainConfig.of(steps=3, seed=SEED, warmup_steps=1, lr=2e-2, min_lr=2e-3, clip_norm=1.0,
                          progress=False, measure_memory=False, init_from=directory, hf_dir=directory, **more)


def _peft_model(directory: Path):  # noqa: ANN202 - a peft PeftModel
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config = LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, bias="none",
                        target_modules=[HF_NAMES[t] for t in LORA.targets])
    return get_peft_model(base, config)


def _peft_params(model) -> dict[str, torch.nn.Parameter]:  # noqa: ANN001 - a PeftModel
    """PEFT's adapter parameters by the names it saves them under."""
    return {name.replace(".default", ""): p for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.timeout(300)
def test_lora_from_hf_weights_gives_peft_losses_and_adapters(hf_models) -> None:
    directory = hf_models["llama"]
    plan = hf_plan(directory, pp=1, dp=1, split="4", zero="0", micro_batches="4")
    layout = dataclasses.replace(plan.layout, adapter=LORA)
    settings = _settings(directory)
    want = reference_run(layout, settings)

    # PEFT's model, its adapters started where medley's start (B is zero in both; A is seeded).
    model = _peft_model(directory)
    start = Decoder(layout.model, init=False, adapter=LORA)
    init_local_shards(start, SEED, adapters_only=True)
    params = _peft_params(model)
    with torch.no_grad():
        for name, value in start.named_parameters():
            if name.endswith(("lora_a", "lora_b")):
                params[peft_name(name)].copy_(value)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trained} == {id(p) for p in params.values()}
    opt = settings.optimizer
    opt_class, kwargs = optimizer_class(opt.name, lr=opt.lr, weight_decay=opt.weight_decay)
    optimizer, schedule = opt_class(trained, **kwargs), LrSchedule.of(opt)
    source = load_data(settings, seq_len=SEQ_LEN, vocab_size=layout.model.vocab_size)
    losses = []
    for step in range(opt.steps):
        set_lr(optimizer, schedule.at(step))
        rows = source.global_rows(step=step, seed=SEED, sequences=layout.sequences_per_step, seq_len=SEQ_LEN)
        loss = token_loss_sum(model(rows.tokens[:, :-1]).logits, rows.targets) / rows.loss_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = math.sqrt(float(sum(p.grad.double().square().sum() for p in trained)))
        for p in trained:
            p.grad.mul_(min(1.0, opt.clip_norm / (norm + 1e-6)))
        optimizer.step()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, want.losses, strict=True)) <= TOL, (losses, want.losses)
    assert all(float(p.abs().max()) > 1e-3 for n, p in params.items() if "lora_B" in n), "B must move"
    ours = {peft_name(n): p for n, p in want.model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    assert set(ours) == set(params)
    assert max(float((ours[n] - params[n]).abs().max()) for n in ours) <= TOL


@pytest.mark.timeout(300)
def test_a_pp2_dp2_zero3_lora_run_exports_for_peft_and_merged(hf_models, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = hf_models["llama"]
    plan = hf_plan(directory, pp=2, dp=2, split="2,2", zero="3,3", micro_batches="2,2")
    plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, adapter=LORA))
    settings = _settings(directory, checkpoint_dir=tmp_path / "ckpt")
    records = train_local(plan, settings)
    want = reference_run(plan.layout, settings)
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL

    step = latest_checkpoint(tmp_path / "ckpt")
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(step), "--hf", str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()
    result = runner.invoke(app, ["export", str(step), "--hf", str(tmp_path / "merged"), "--merge"])
    assert result.exit_code == 0, result.output

    tokens = torch.randint(0, plan.layout.model.vocab_size, (2, SEQ_LEN),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = want.model(tokens)
        base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        assert float((merged(tokens).logits - expected).abs().max()) <= 1e-4
