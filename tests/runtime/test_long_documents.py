"""Issue 26, finding 6: a long document is tokenized in bounded memory (one 20 MB jsonl document
took 37 s and 3.4 GB, a whole document went into one encode_batch), with exactly the ids
whole-document encoding gives, for the usual kinds of tokenizer; and no temporary file is left."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from data_sets import DOCS, expected_stream, write_jsonl
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from medley.data import cache as cache_module
from medley.data import streaming
from medley.data.load import DataOptions, load_source

CORPUS = resources.files("medley.data").joinpath("corpus.txt").read_text(encoding="utf-8")
SEQ = 8


def _train(model: models.Model, trainer: trainers.Trainer, *, normalizer=None, pre_tokenizer=None,  # noqa: ANN001
           decoder=None) -> Tokenizer:  # noqa: ANN001
    tokenizer = Tokenizer(model)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        tokenizer.decoder = decoder
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def _tokenizers(bpe_tokenizer: Path) -> dict[str, Tokenizer]:
    """The suite's Metaspace BPE and the other usual kinds: GPT-2's byte-level BPE, SentencePiece
    (LLaMA-2) BPE with no pre-tokenizer and byte fallback, BERT's WordPiece, a Unigram model."""
    special = ["<|endoftext|>", "<unk>"]
    return {
        "metaspace-bpe": Tokenizer.from_file(str(bpe_tokenizer)),
        "byte-level-bpe": _train(
            models.BPE(), trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
            pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False), decoder=decoders.ByteLevel()),
        "sentencepiece-bpe": _train(
            models.BPE(unk_token="<unk>", byte_fallback=True),
            trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False),
            normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])),
        "wordpiece": _train(
            models.WordPiece(unk_token="<unk>"),
            trainers.WordPieceTrainer(vocab_size=400, special_tokens=special, show_progress=False),
            normalizer=normalizers.BertNormalizer(), pre_tokenizer=pre_tokenizers.BertPreTokenizer()),
        "unigram": _train(
            models.Unigram(),
            trainers.UnigramTrainer(vocab_size=300, special_tokens=special, unk_token="<unk>",
                                    show_progress=False),
            pre_tokenizer=pre_tokenizers.Metaspace()),
    }


def _hard_text() -> str:
    """Prose plus what makes cutting hard: runs of spaces, tabs and newlines, non-ASCII and
    astral characters (several byte tokens per character), a word far longer than the margin."""
    rng = np.random.default_rng(7)
    words = CORPUS.split()
    extras = ["   ", "\n\n", "\t", " \n ", "héllo", "naïve", "日本語", "🍞🥖", "x" * 300, "<|endoftext|>"]
    parts = []
    for _ in range(5000):
        parts.append(str(rng.choice(extras)) if rng.random() < 0.08 else str(rng.choice(words)))
        parts.append(" " if rng.random() < 0.9 else "\n")
    return "".join(parts)


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 600 characters and margins of 48, so a 40 kB text makes about 70 cuts."""
    for name, value in dict(WINDOW=600, MARGIN=48, ZONE=24, BATCH=3, MAX_SPAN=1 << 15).items():
        monkeypatch.setattr(streaming, name, value)
    monkeypatch.setattr(cache_module, "_LONG", 1200)


@pytest.mark.usefixtures("small_windows")
def test_windowed_encoding_equals_whole_document_encoding(bpe_tokenizer: Path) -> None:
    text = _hard_text()
    rng = np.random.default_rng(1)
    bounds = np.sort(rng.integers(0, len(text), 60))
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]  # any sizes
    for name, tokenizer in _tokenizers(bpe_tokenizer).items():
        want = tokenizer.encode(text, add_special_tokens=False).ids
        got = np.concatenate(list(streaming.encode_long(tokenizer, pieces)))
        assert got.tolist() == want, name
    one = _tokenizers(bpe_tokenizer)["metaspace-bpe"]
    assert np.concatenate(list(streaming.encode_long(one, ["", ""]))).size == 0  # an empty document


@pytest.mark.usefixtures("small_windows")
def test_a_run_longer_than_the_margin_grows_the_window(bpe_tokenizer: Path) -> None:
    """No whitespace for 5,000 characters: the windows around those cuts disagree until one spans
    the run; the ids still equal whole-document encoding."""
    tokenizer = Tokenizer.from_file(str(bpe_tokenizer))
    text = CORPUS[:3000] + "bread" * 1000 + CORPUS[3000:6000]
    got = np.concatenate(list(streaming.encode_long(tokenizer, streaming.pieces_of(text))))
    assert got.tolist() == tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.usefixtures("small_windows")
def test_long_documents_and_plain_text_in_the_cache_equal_whole_encoding(tmp_path: Path, bpe_tokenizer) \
        -> None:
    long = " ".join(DOCS) * 20  # 16 kB: encoded in windows
    docs = [DOCS[0], long, DOCS[1], long[:1500], ""]
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache")
    source = load_source(write_jsonl(tmp_path / "d.jsonl", docs), seq_len=SEQ, options=options)
    assert np.array_equal(np.asarray(source.train.tokens), expected_stream(bpe_tokenizer, docs))
    (tmp_path / "t.txt").write_text(long + "\n" + long)
    text = load_source(tmp_path / "t.txt", seq_len=SEQ, options=options)
    assert np.array_equal(np.asarray(text.train.tokens), expected_stream(bpe_tokenizer, [long + "\n" + long]))
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


MEASURE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from medley.data import streaming
    from medley.data.cache import cached_tokens, load_tokenizer

    def kib(field):  # VmRSS: now; VmHWM: the peak since the reset below
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1])

    streaming.BATCH = 1  # the figure should not depend on the machine's core count
    tokenizer = load_tokenizer(sys.argv[2])
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak to the current size (Linux)
    before = kib("VmRSS")
    start = time.monotonic()
    tokens, meta = cached_tokens(Path(sys.argv[1]), "jsonl", tokenizer=tokenizer, field="text",
                                 cache_dir=Path(sys.argv[3]), flag="--data")
    print((kib("VmHWM") - before) * 1024, meta["tokens"], time.monotonic() - start)
""")


@pytest.mark.timeout(120)
def test_a_long_jsonl_document_is_tokenized_in_bounded_memory(tmp_path: Path, bpe_tokenizer) -> None:
    """A 4 MB document: the old path's peak grew by about 170x the file (700 MB), the windowed one
    by the document's text (read whole with its line) and a few windows."""
    repeat = 4 * 2**20 // len(CORPUS) + 1
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": (CORPUS * repeat)[:4 * 2**20]}) + "\n")
    args = [sys.executable, "-c", MEASURE, str(data), str(bpe_tokenizer), str(tmp_path / "cache")]
    grown, tokens, seconds = (float(x) for x in subprocess.run(
        args, capture_output=True, text=True, check=True, timeout=110).stdout.split())
    size = data.stat().st_size
    assert tokens > 1_000_000
    print(f"{size / 2**20:.1f} MiB document: peak RSS +{grown / 2**20:.0f} MiB, {seconds:.1f} s")
    assert grown < 10 * size, f"peak RSS grew by {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
