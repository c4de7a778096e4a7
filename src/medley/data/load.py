"""``--data`` and its options to a :class:`~medley.data.source.DataSource`.

Call :func:`load_source` once in the launching process (it checks everything and builds a text
data set's token cache) before ranks start; ranks call it again with ``verify=False`` and only map
the cache or the token file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from medley.data.cache import TextTokenizer, cached_tokens, load_tokenizer
from medley.data.chat import load_chat_template
from medley.data.examples import Examples, cached_examples, data_kind, usable
from medley.data.formats import data_format
from medley.data.source import BYTE_VOCAB, SYNTHETIC, DataSource
from medley.data.tokens import (
    DEFAULT_TOKEN_DTYPE,
    check_ids,
    check_not_wider,
    file_fingerprint,
    open_token_file,
    token_dtype,
)
from medley.data.windows import Windows, held_out, split_windows, window_count
from medley.errors import MedleyInputError
from medley.fileio import read_user_bytes

SHIPPED_CORPUS = "corpus.txt"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/medley/tokens`` (``~/.cache/medley/tokens``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "medley" / "tokens"


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """How to read ``--data`` (and ``--val-data``).

    Attributes:
        tokenizer: ``--tokenizer``: a tokenizer.json (or its directory) for text data; None reads
            plain text as bytes (and refuses other text formats).
        text_field: ``--text-field``: the JSON field or column holding the text.
        token_dtype: ``--token-dtype`` of ``.bin`` token files (uint16 or uint32); None: the
            Megatron ``.idx`` beside it, else uint16 (nanoGPT).
        cache_dir: ``--data-cache``: where token caches go; None: :func:`default_cache_dir`.
        val_fraction: ``--val-fraction``: hold out this share of the windows (the last ones).
        kind: ``--data-format``: ``auto`` (a ``messages`` field: conversations; ``prompt`` and
            ``completion``: pairs; else text), ``text``, ``chat`` or ``completion``
            (:mod:`.examples`).
        chat_template: ``--chat-template``: a Jinja file for conversations; None: the tokenizer
            directory's (``chat_template.jinja`` or ``tokenizer_config.json``).
        pack: ``--pack``: several examples per sequence (:mod:`.packing`).
        seed: ``--seed``, the data order's: the packing statistics reported are of its first epoch.
    """

    tokenizer: str | None = None
    text_field: str = "text"
    token_dtype: str | None = None
    cache_dir: Path | None = None
    val_fraction: float = 0.0
    kind: str = "auto"
    chat_template: str | None = None
    pack: bool = False
    seed: int = 0


def load_source(data: str | Path | None, *, seq_len: int, options: DataOptions | None = None,
                vocab_size: int = BYTE_VOCAB, val_data: str | Path | None = None,
                verify: bool = True) -> DataSource:
    """The shipped corpus (``None``), the synthetic source, or a data set (see :mod:`.formats`);
    validation windows from ``val_data`` (all of it) or ``options.val_fraction``."""
    options = options or DataOptions()
    if not 0 <= options.val_fraction < 1:
        raise MedleyInputError(f"--val-fraction {options.val_fraction} must be in [0, 1); e.g. 0.05")
    if val_data is not None and options.val_fraction:
        raise MedleyInputError("--val-data and --val-fraction: give one of them")
    kind = "text" if data in (None, SYNTHETIC) else data_kind(
        Path(data), data_format(Path(data), flag="--data"), kind=options.kind, text_field=options.text_field,
        flag="--data")
    if options.pack and kind == "text":
        raise MedleyInputError(f"--pack: {data or 'the shipped corpus'} is text, which fills every sequence "
                               "already (windows of the token stream); pack chat or prompt/completion data, "
                               "or drop --pack")
    if data == SYNTHETIC:
        if options.val_fraction or val_data is not None:
            raise MedleyInputError("--val-fraction/--val-data: the synthetic source has no validation set; "
                                   "give --data FILE or drop them")
        return DataSource(name=SYNTHETIC, fingerprint=SYNTHETIC)
    if kind != "text":
        assert data is not None
        return _example_source(Path(data), kind=kind, seq_len=seq_len, options=options,
                               vocab_size=vocab_size, val_data=val_data, verify=verify)
    tokens, digest, is_bytes = _tokens(data, options=options, vocab_size=vocab_size, flag="--data",
                                       verify=verify)
    name = f"shipped:{SHIPPED_CORPUS}" if data is None else str(data)
    make = _byte_source if is_bytes else _token_source
    source = make(tokens, name=name, digest=digest, seq_len=seq_len, options=options)
    if val_data is None or val_data == SYNTHETIC:
        if val_data == SYNTHETIC:
            raise MedleyInputError("--val-data synthetic: give a data file")
        return source
    val_tokens, _, _ = _tokens(val_data, options=options, vocab_size=vocab_size, flag="--val-data",
                               verify=verify)
    val = Windows(tokens=val_tokens, seq_len=seq_len, first=0, count=window_count(len(val_tokens), seq_len))
    _check_val(val, name=str(val_data), flag="--val-data")
    return dataclasses.replace(source, val=val)


def _tokens(data: str | Path | None, *, options: DataOptions, vocab_size: int, flag: str,
            verify: bool) -> tuple[np.ndarray, str, bool]:
    """The token ids of ``data`` (mapped, never read whole, unless byte text), their fingerprint,
    and whether they are the bytes of a plain text read without tokenizer."""
    if data is None and options.tokenizer is None:
        text = resources.files("medley.data").joinpath(SHIPPED_CORPUS).read_bytes()
        _check_byte_vocab(vocab_size, flag=flag, name=f"shipped:{SHIPPED_CORPUS}")
        return np.frombuffer(text, dtype=np.uint8), hashlib.sha256(text).hexdigest()[:16], True
    path = Path(data) if data is not None else Path(str(resources.files("medley.data") / SHIPPED_CORPUS))
    fmt = data_format(path, flag=flag)
    if fmt == "tokens":
        dtype = token_dtype(path, options.token_dtype)
        tokens = open_token_file(path, dtype=dtype, flag=flag)
        if verify:
            if options.token_dtype is None and dtype == DEFAULT_TOKEN_DTYPE:
                check_not_wider(path, tokens, flag=flag)
            check_ids(path, tokens, vocab_size=vocab_size, flag=flag, dtype=dtype)
        return tokens, f"{dtype}:{file_fingerprint(path)}", False
    if options.tokenizer is None:
        if fmt != "text":
            raise MedleyInputError(f"{flag} {path}: {fmt} data needs a tokenizer; pass --tokenizer "
                                   "tokenizer.json or a --model DIR that has one")
        _check_byte_vocab(vocab_size, flag=flag, name=str(path))
        text = _read_bytes(path, flag=flag)
        return text, hashlib.sha256(text.tobytes()).hexdigest()[:16], True
    tokenizer = _checked_tokenizer(options.tokenizer, vocab_size)
    tokens, meta = cached_tokens(path, fmt, tokenizer=tokenizer, field=options.text_field,
                                 cache_dir=Path(options.cache_dir or default_cache_dir()), flag=flag,
                             verify=verify)
    return tokens, meta["sha256"][:16], False


def _examples(path: Path, *, kind: str, seq_len: int, options: DataOptions, vocab_size: int, flag: str,
              verify: bool) -> tuple[Examples, str, int]:
    """The usable examples of ``path``, their fingerprint, and how many were cut to length."""
    fmt = data_format(path, flag=flag)
    if options.tokenizer is None:
        raise MedleyInputError(f"{flag} {path}: {kind} data needs a tokenizer; pass --tokenizer "
                               "tokenizer.json or a --model DIR that has one")
    tokenizer = _checked_tokenizer(options.tokenizer, vocab_size)
    template = load_chat_template(tokenizer.path.parent, options.chat_template) if kind == "chat" else None
    arrays, digest = cached_examples(path, fmt, kind=kind, tokenizer=tokenizer, template=template,
                             cache_dir=Path(options.cache_dir or default_cache_dir()), flag=flag,
                             verify=verify)
    order, cut = usable(arrays["first"], arrays["offsets"], seq_len=seq_len)
    examples = Examples(ids=arrays["ids"], mask=arrays["mask"], offsets=arrays["offsets"], order=order,
                        seq_len=seq_len, pad_id=tokenizer.eos_id)
    return examples, digest, cut


def _example_source(path: Path, *, kind: str, seq_len: int, options: DataOptions, vocab_size: int,
                    val_data: str | Path | None, verify: bool) -> DataSource:
    """Conversations or prompt/completion pairs (:mod:`.examples`), the last ``val_fraction``
    of them (or ``val_data``'s) for validation."""
    examples, digest, cut = _examples(path, kind=kind, seq_len=seq_len, options=options,
                                      vocab_size=vocab_size, flag="--data", verify=verify)
    total = len(examples.offsets) - 1
    notes = [f"--data {path}: {total:,} {'conversations' if kind == 'chat' else 'prompt/completion pairs'}, "
             f"{cut:,} cut to {seq_len + 1} tokens, {total - examples.count:,} left out (nothing learned in "
             "their first tokens); the loss counts the "
             f"{'assistant' if kind == 'chat' else 'completion'} tokens only"]
    held = held_out(examples.count, options.val_fraction)
    train = examples.part(0, examples.count - held)
    val = examples.part(examples.count - held, examples.count) if held else None
    if held:
        digest += f":val{options.val_fraction}"
    if val_data is not None:
        if val_data == SYNTHETIC:
            raise MedleyInputError("--val-data synthetic: give a data file")
        val, _, _ = _examples(Path(val_data), kind=kind, seq_len=seq_len, options=options,
                              vocab_size=vocab_size, flag="--val-data", verify=verify)
    if train.count < 2:
        raise MedleyInputError(f"--data {path}: {train.count} usable examples (at least 2); give more data, "
                               "a longer --seq-len or a smaller --val-fraction")
    if val is not None and val.count < 1:
        raise MedleyInputError("--val-data/--val-fraction: no usable validation example; give more "
                               "validation data or a longer --seq-len")
    if options.pack:
        digest += ":packed"
    source = DataSource(name=str(path), fingerprint=digest, examples=train, val_examples=val,
                        packed=options.pack, notes=tuple(notes))
    if not verify:  # a rank: the launching process reported the packing
        return source
    stats = source.packer().stats(options.seed)  # kept: --epochs reads it again
    if options.pack:
        notes.append(f"--pack: {stats.describe()}")
    else:
        notes.append(f"--data {path}: one example per sequence, {1 - stats.unpacked_efficiency:.0%} of the "
                     f"positions are padding; --pack would fill {stats.efficiency:.0%} of them")
    return dataclasses.replace(source, notes=tuple(notes))


def _checked_tokenizer(given: str | Path, vocab_size: int) -> TextTokenizer:
    tokenizer = load_tokenizer(given)
    if tokenizer.vocab_size > vocab_size:
        raise MedleyInputError(f"--tokenizer {tokenizer.path}: {tokenizer.vocab_size} tokens, more than the "
                               f"model's vocab_size {vocab_size}; use a model with a larger vocabulary")
    return tokenizer


def _check_byte_vocab(vocab_size: int, *, flag: str, name: str) -> None:
    """Text read as bytes has ids up to 255: the model's vocabulary must hold them."""
    if vocab_size < BYTE_VOCAB:
        raise MedleyInputError(
            f"{flag} {name}: text without a tokenizer is read as bytes (ids up to {BYTE_VOCAB - 1}) but the "
            f"model's vocab_size is {vocab_size}; pass --tokenizer tokenizer.json or a --model DIR with one")


def _read_bytes(path: Path, *, flag: str) -> np.ndarray:
    raw = read_user_bytes(path, what="data file", flag=flag)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MedleyInputError(f"{flag} {path}: not UTF-8 text (byte {err.start}); give a text file or "
                               "'synthetic'") from None
    return np.frombuffer(raw, dtype=np.uint8)


def _byte_source(text: np.ndarray, *, name: str, digest: str, seq_len: int,
                 options: DataOptions) -> DataSource:
    """Byte ids of a text; the last ``val_fraction`` of it held out for validation."""
    held = int(len(text) * options.val_fraction)
    train = text[:len(text) - held]
    if len(train) < 2 * (seq_len + 1):
        what = "is empty" if not len(text) else f"has {len(train)} bytes, too few"
        raise MedleyInputError(
            f"--data {name}: {what} for sequences of {seq_len} tokens (at least {2 * (seq_len + 1)} bytes); "
            "give a longer text or a shorter --seq-len")
    val = None
    if held:
        val = Windows(tokens=text[len(train):], seq_len=seq_len, first=0, count=window_count(held, seq_len))
        _check_val(val, name=name, flag="--data")
    if held:
        digest += f":val{options.val_fraction}"
    return DataSource(name=name, fingerprint=digest, text=train, val=val)


def _token_source(tokens: np.ndarray, *, name: str, digest: str, seq_len: int,
                  options: DataOptions) -> DataSource:
    train, val = split_windows(tokens, seq_len=seq_len, val_fraction=options.val_fraction)
    if train.count < 2:
        raise MedleyInputError(
            f"--data {name}: {len(tokens)} tokens make {train.count} training sequences of {seq_len} tokens "
            "(at least 2); give more data, a shorter --seq-len or a smaller --val-fraction")
    if val is not None:
        _check_val(val, name=name, flag="--data")
        digest += f":val{options.val_fraction}"
    return DataSource(name=name, fingerprint=digest, train=train, val=val)


def _check_val(val: Windows, *, name: str, flag: str) -> None:
    if val.count < 1:
        what = "the held-out part of --data" if flag == "--data" else "--val-data"
        raise MedleyInputError(f"{flag if flag != '--data' else '--val-fraction'}: {what} {name} holds no "
                               "whole sequence; give more validation data or a shorter --seq-len")
