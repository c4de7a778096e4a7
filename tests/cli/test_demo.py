"""The README's demo, end to end with a short emulated run and a short Hugging Face fine-tune
whose export transformers loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from medley.cli.demo import run_demo
from medley.cli.demo_hf import hf_finetune
from medley.plan.plan import load_plan


@pytest.mark.timeout(300)
def test_demo_plans_simulates_and_trains(tmp_path: Path) -> None:
    figures = run_demo(out_dir=tmp_path, model_name="llama-2-7b", console=Console(quiet=True), train_steps=8,
                       hf_steps=2)
    best = figures["plan"]["plans"][0]
    assert all(ratio is None or ratio >= 1.0 for ratio in best["versus_baselines"].values())
    assert figures["zero_placement"]["bubble"] < figures["zero_placement"]["naive"]
    run = figures["run"]
    assert run["predicted_s"] > 0 and 0 < run["fastest_s"] <= run["median_s"]
    assert run["loss_last"] < run["loss_first"]
    for name in ("demo-plan.toml", "demo-emulated-plan.toml", "demo-gantt.png", "demo-trace.json",
                 "demo-profile-cpu.json", "demo-times.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert set(figures["seconds"]) == {"plan", "zero_placement", "run", "hf"}
    assert load_plan(tmp_path / "demo-emulated-plan.toml").shared.clip_grad
    hf = figures["hf"]
    exported = Path(hf["export"])
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    assert not (tmp_path / ".demo-hf-finetuned.checkpoints").exists(), "the temporary checkpoints are removed"
    base, tuned = (load_file(d / "model.safetensors") for d in (tmp_path / "demo-hf-base", exported))
    assert any(not torch.equal(base[name], tuned[name]) for name in base), "the steps must change the weights"
    if importlib.util.find_spec("transformers") is not None:
        assert hf["generated"].startswith("The river") and len(hf["generated_ids"]) > 2
    # The demo run again into the same --out (as `scripts/demo.sh` twice does) replaces its own
    # Hugging Face directories instead of stopping at "demo-hf-base: File exists".
    again = hf_finetune(out_dir=tmp_path, plan=load_plan(tmp_path / "demo-emulated-plan.toml"), steps=1,
                        emulate=True, console=Console(quiet=True))
    assert Path(again["export"]) == exported and (exported / "model.safetensors").stat().st_size > 0
