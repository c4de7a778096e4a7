"""Fixtures of the runtime tests: small BPE tokenizers trained on the shipped corpus."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def train_bpe(path: Path, vocab_size: int) -> Path:
    """A BPE tokenizer of at most ``vocab_size`` tokens (EOS and UNK included), saved at ``path``."""
    text = resources.files("medley.data").joinpath("corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, "<unk>"], show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(), trainer=trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json of 256 tokens or fewer: it fits the tiny model's vocabulary."""
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", 256)


@pytest.fixture(scope="session")
def large_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json of more than 256 tokens: too many for the tiny model."""
    return train_bpe(tmp_path_factory.mktemp("bpe_large") / "tokenizer.json", 400)
