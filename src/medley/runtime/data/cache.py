"""Tokenize a text data set once into a memory-mapped token cache, as Megatron-LM's preprocessing.

The cache is two files in the cache directory: ``<key>.tokens`` (raw ids, uint16 when the
tokenizer's vocabulary fits, else uint32) and ``<key>.json`` (dtype, token and document counts,
the hash of the ids). The key hashes the input files (path, size, modification time), the
tokenizer file's bytes and the text field: a changed input makes a new cache. Documents are read
and tokenized a batch at a time (``encode_batch``) and each is followed by the EOS token; both
files are written under temporary names and renamed into place, the ``.json`` last, so a cache
is whole or absent. The launching process builds it before any rank starts; ranks map it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from medley.errors import MedleyInputError
from medley.fileio import write_atomically
from medley.runtime.data.formats import documents, input_files

CACHE_VERSION = 1
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_BATCH_DOCS = 256


@dataclass(frozen=True, kw_only=True)
class TextTokenizer:
    """A ``tokenizers`` tokenizer and its end-of-document token.

    Attributes:
        path: the tokenizer.json file.
        tokenizer: the loaded tokenizer.
        eos_id: id of the token put after each document.
        vocab_size: ids it can produce (added tokens included).
        digest: hash of the tokenizer file.
    """

    path: Path
    tokenizer: Tokenizer
    eos_id: int
    vocab_size: int
    digest: str


def load_tokenizer(given: str | Path) -> TextTokenizer:
    """``--tokenizer``: a tokenizer.json file or a directory holding one."""
    path = Path(given)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise MedleyInputError(f"--tokenizer {given}: no tokenizer.json there; give a tokenizers "
                               "tokenizer.json file or its directory")
    try:
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise MedleyInputError(f"--tokenizer {path}: not a tokenizers tokenizer.json ({err}); check the "
                               "file") from None
    found = (tokenizer.token_to_id(t) for t in EOS_CANDIDATES)
    eos = next((i for i in found if i is not None), None)
    if eos is None:
        raise MedleyInputError(f"--tokenizer {path}: no end-of-document token (one of "
                               f"{', '.join(EOS_CANDIDATES)}); add one to the tokenizer")
    return TextTokenizer(path=path, tokenizer=tokenizer, eos_id=eos, digest=hashlib.sha256(raw).hexdigest(),
                         vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))


def cache_key(path: Path, fmt: str, *, tokenizer: TextTokenizer, field: str) -> str:
    files = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in input_files(path, fmt)]
    spec = {"version": CACHE_VERSION, "files": files, "tokenizer": tokenizer.digest,
            "field": field if fmt != "text" else None}
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:24]


def cached_tokens(path: Path, fmt: str, *, tokenizer: TextTokenizer, field: str, cache_dir: Path,
                  flag: str) -> tuple[np.memmap, dict]:
    """The token cache of a text data set (built now if absent), memory-mapped, and its metadata."""
    key = cache_key(path, fmt, tokenizer=tokenizer, field=field)
    tokens_path, meta_path = cache_dir / f"{key}.tokens", cache_dir / f"{key}.json"
    if not (meta_path.is_file() and tokens_path.is_file()):
        _build(path, fmt, tokenizer=tokenizer, field=field, tokens_path=tokens_path, meta_path=meta_path,
               flag=flag)
    meta = json.loads(meta_path.read_text())
    if meta["tokens"] == 0:
        raise MedleyInputError(f"{flag} {path}: no text in it (0 tokens); give a data set with text")
    return np.memmap(tokens_path, dtype=meta["dtype"], mode="r"), meta


def _build(path: Path, fmt: str, *, tokenizer: TextTokenizer, field: str, tokens_path: Path, meta_path: Path,
           flag: str) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    try:
        tokens_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=tokens_path.parent, prefix=f".{tokens_path.name}.", suffix=".tmp")
    except OSError as err:
        raise MedleyInputError(f"--data-cache {tokens_path.parent}: cannot write ({err.strerror}); choose "
                               "another --data-cache") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            counts = _write_tokens(path, fmt, handle, tokenizer=tokenizer, field=field, dtype=dtype,
                                   flag=flag)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, tokens_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    meta = {"version": CACHE_VERSION, "source": str(path), "format": fmt, "field": field,
            "tokenizer": str(tokenizer.path), "dtype": np.dtype(dtype).name, **counts}
    write_atomically(meta_path, json.dumps(meta, indent=1) + "\n")


def _write_tokens(path: Path, fmt: str, handle, *, tokenizer: TextTokenizer, field: str,  # noqa: ANN001
                  dtype: type, flag: str) -> dict:
    """Stream the documents into ``handle``: counts and the hash of the ids written."""
    digest, total, docs = hashlib.sha256(), 0, 0
    batch: list[str] = []

    def flush(end_of_document: bool) -> None:
        nonlocal total
        ids: list[int] = []
        for encoding in tokenizer.tokenizer.encode_batch(batch, add_special_tokens=False):
            ids += encoding.ids
            if end_of_document:
                ids.append(tokenizer.eos_id)
        array = np.asarray(ids, dtype=dtype)
        handle.write(array.tobytes())
        digest.update(array.tobytes())
        total += len(array)
        batch.clear()

    for text in documents(path, fmt, field=field, flag=flag):
        batch.append(text)
        docs += 1
        if len(batch) == _BATCH_DOCS:
            flush(fmt != "text")
    flush(fmt != "text")
    if fmt == "text" and total:  # plain text is one document read in pieces: one EOS at its end
        eos = np.asarray([tokenizer.eos_id], dtype=dtype)
        handle.write(eos.tobytes())
        digest.update(eos.tobytes())
        total += 1
    return {"tokens": total, "documents": docs if fmt != "text" else 1, "sha256": digest.hexdigest()}
