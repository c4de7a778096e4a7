"""The Hugging Face tests' model directories, saved once per session with transformers'
``save_pretrained``, each with the suite's BPE tokenizer (tests/conftest.py) beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import hf_configs, randomise

from medley.data.bpe import EOS


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory, bpe_tokenizer: Path) -> dict[str, Path]:
    """family -> model directory; ``llama`` is saved in several shards with an index."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for seed, (family, cfg) in enumerate(hf_configs().items()):
        directory = tmp_path_factory.mktemp(f"hf_{family}")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomise(model, seed)
        model.save_pretrained(directory, max_shard_size="40KB" if family == "llama" else "1GB")
        shutil.copy(bpe_tokenizer, directory / "tokenizer.json")
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "unk_token": "<unk>"}))
        dirs[family] = directory
    return dirs
