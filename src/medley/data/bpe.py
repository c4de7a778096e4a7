"""A small BPE tokenizer trained on the shipped corpus (the demo's and the tests' tokenizer.json),
and the same with ChatML's markers and template (the chat tests' and benchmarks')."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

EOS = "<|endoftext|>"
UNK = "<unk>"
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
"""ChatML as a Jinja chat template (Qwen2's, without a default system turn)."""


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


def chatml_tokenizer(directory: Path, vocab_size: int = 250) -> Path:
    """A tokenizer directory: :func:`train_bpe` of ``vocab_size`` tokens with ``<|im_start|>`` and
    ``<|im_end|>`` added as special tokens (252 tokens by default: it fits the tiny model), and
    :data:`CHATML` as the template of its tokenizer_config.json."""
    from tokenizers import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    train_bpe(directory / "tokenizer.json", vocab_size)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": EOS, "unk_token": UNK, "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
