"""The demo's Hugging Face part without training: the model directory medley writes is read back
as the same model, transformers' greedy continuation of it is medley's, and without transformers
generation is skipped."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from medley.cli.demo_hf import HF_VOCAB, NEW_TOKENS, PROMPT, generate, write_model_dir
from medley.runtime.hf_weights import load_hf_weights
from medley.runtime.transformer import Decoder
from medley.spec.model_arg import get_model


def medley_greedy(directory: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """medley's own greedy continuation by the model saved in ``directory``."""
    model = Decoder(get_model(str(directory)), init=False)
    load_hf_weights(model, directory)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = replace(get_model("tiny"), vocab_size=HF_VOCAB)
    return write_model_dir(tmp_path_factory.mktemp("demo_hf") / "base", spec, seed=1)


def test_the_written_directory_is_the_seeded_model(model_dir: Path) -> None:
    spec = get_model(str(model_dir))
    assert replace(spec, name="m") == replace(get_model("tiny"), vocab_size=HF_VOCAB, name="m")
    loaded = Decoder(spec, init=False)
    load_hf_weights(loaded, model_dir)
    seeded = Decoder(spec, seed=1).state_dict()
    assert all(torch.equal(t, seeded[name]) for name, t in loaded.state_dict().items())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == HF_VOCAB and tokenizer.decode(tokenizer.encode(PROMPT).ids) == PROMPT


def test_transformers_continues_as_medley_does(model_dir: Path) -> None:
    pytest.importorskip("transformers")
    generation = generate(model_dir, PROMPT, new_tokens=NEW_TOKENS)
    assert generation is not None and len(generation.ids) == len(generation.prompt_ids) + NEW_TOKENS
    assert generation.ids == medley_greedy(model_dir, generation.prompt_ids, NEW_TOKENS)
    assert generation.text.startswith(PROMPT)


def test_without_transformers_generation_is_skipped(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert generate(model_dir, PROMPT, new_tokens=1) is None
