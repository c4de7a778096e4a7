"""A small BPE tokenizer trained on the shipped corpus (the demo's and the tests' tokenizer.json)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

EOS = "<|endoftext|>"
UNK = "<unk>"


def train_bpe(path: Path, vocab_size: int) -> Path:
    """Train a BPE tokenizer of at most ``vocab_size`` tokens (EOS and UNK included) on
    ``medley/data/corpus.txt`` and save it at ``path``. Words keep their leading space as ``▁``
    (Metaspace), so decoding gives the text back, spaces included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = resources.files("medley.data").joinpath("corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, UNK], show_progress=False)
    tokenizer.train_from_iterator([text], trainer=trainer)
    tokenizer.save(str(path))
    return path
