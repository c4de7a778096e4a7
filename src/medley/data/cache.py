"""Tokenize a text data set once into a memory-mapped token cache, as Megatron-LM's preprocessing.

The cache is two files in the cache directory: ``<key>.tokens`` (raw ids, uint16 when the
tokenizer's vocabulary fits, else uint32) and ``<key>.json`` (dtype, token, text-token and
document counts, the sha256 of the ids). The key hashes the input files (path, size,
modification time), the tokenizer file's bytes and the text field: a changed input makes a new
cache. Documents are read and tokenized a batch at a time (``encode_batch``), a long one (and a
plain text file) window by window (:mod:`.streaming`), and each is followed by the EOS token;
both files are written under temporary names and renamed into place, the ``.json`` last, so a
cache is whole or absent. A cache is used only once its ``.json`` reads back with the fields
and types written, its ``.tokens`` holds exactly the ids it counts and, in the launching
process, the ids hash to the recorded sha256 and lie in the tokenizer's vocabulary: anything
else (a truncated or edited file, a garbage ``.json``) is rebuilt. The launching process builds
it before any rank starts; ranks map it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tokenizers import Tokenizer

from medley.data.formats import documents, input_files
from medley.data.streaming import WINDOW, encode_long, pieces_of
from medley.errors import MedleyInputError
from medley.fileio import (
    check_regular_file,
    open_user_file,
    os_error_message,
    read_user_bytes,
    write_atomically,
)

CACHE_VERSION = 2
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_BATCH_DOCS = 256  # short documents per encode_batch call, at most
_BATCH_CHARS = 4 * WINDOW  # and at most about this many characters
_LONG = 2 * WINDOW  # a longer document is encoded window by window
_SCAN = 1 << 22  # ids read at a time when verifying a cache
_DTYPES = ("uint16", "uint32")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    if not path.exists():
        raise MedleyInputError(f"--tokenizer {given}: no tokenizer.json there; give a tokenizers "
                               "tokenizer.json file or its directory")
    raw = read_user_bytes(path, what="tokenizer file", flag="--tokenizer")
    try:
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
    if fmt in ("parquet", "arrow"):  # their null texts were once dropped: a cache of that is not reused
        spec["null_texts"] = "refused"
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:24]


def cached_tokens(path: Path, fmt: str, *, tokenizer: TextTokenizer, field: str, cache_dir: Path,
                  flag: str, verify: bool = True) -> tuple[np.memmap, dict]:
    """The token cache of a text data set, memory-mapped, and its metadata: built now if absent
    or not whole (see the module docstring); ``verify`` also hashes and range-checks its ids."""
    key = cache_key(path, fmt, tokenizer=tokenizer, field=field)
    tokens_path, meta_path = cache_dir / f"{key}.tokens", cache_dir / f"{key}.json"
    meta = _checked(tokens_path, meta_path, fmt, tokenizer=tokenizer, full=verify)
    if meta is None:
        _build(path, fmt, tokenizer=tokenizer, field=field, tokens_path=tokens_path, meta_path=meta_path,
               flag=flag)
        meta = _checked(tokens_path, meta_path, fmt, tokenizer=tokenizer, full=False)
        if meta is None:
            raise MedleyInputError(f"--data-cache {meta_path}: the token cache just built does not read "
                                   "back whole (another process writing it?); run again or choose another "
                                   "--data-cache")
    if meta["text_tokens"] == 0:
        what = f"{meta['documents']} documents with no text" if meta["documents"] else "no text in it"
        raise MedleyInputError(f"{flag} {path}: {what} (0 tokens besides end-of-document ones); give a data "
                               "set with text")
    return np.memmap(tokens_path, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],)), meta


def _count(meta: dict, key: str) -> bool:
    value = meta.get(key)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_meta(meta_path: Path, fmt: str) -> dict | None:
    """The cache's ``.json`` if it reads back with the fields and types medley writes and its
    counts agree (every document but plain text's empty one ends in an EOS), else None."""
    try:
        with open_user_file(meta_path, what="token cache index") as handle:
            meta = json.loads(handle.read(1 << 20))
    except (MedleyInputError, OSError, ValueError, RecursionError):
        return None
    if not isinstance(meta, dict) or meta.get("version") != CACHE_VERSION or meta.get("dtype") not in _DTYPES:
        return None
    if not all(_count(meta, key) for key in ("tokens", "text_tokens", "documents")):
        return None
    if fmt == "text" and meta["documents"] != 1:
        return None
    if meta["tokens"] - meta["text_tokens"] != _eos_count(meta, fmt):
        return None
    return meta if isinstance(meta.get("sha256"), str) and _SHA256.fullmatch(meta["sha256"]) else None


def _eos_count(meta: dict, fmt: str) -> int:
    """EOS ids the build appended: one per document (a plain text file: one, when it has text)."""
    return meta["documents"] if fmt != "text" else int(meta["tokens"] > 0)


def _checked(tokens_path: Path, meta_path: Path, fmt: str, *, tokenizer: TextTokenizer, full: bool
             ) -> dict | None:
    """The metadata of a whole cache (its ``.tokens`` the size its ``.json`` counts, in the dtype
    this tokenizer needs; with ``full`` its ids hashing to the recorded sha256, each below the
    vocabulary size, the EOS ids at least as many as its documents), else None: build it again."""
    meta = _read_meta(meta_path, fmt)
    if meta is None or meta["dtype"] != id_dtype(tokenizer).__name__:
        return None
    try:
        check_regular_file(tokens_path, what="token cache")
        size = tokens_path.stat().st_size
    except (MedleyInputError, OSError):
        return None
    if size != meta["tokens"] * np.dtype(meta["dtype"]).itemsize:
        return None
    if full and not _ids_match(tokens_path, meta, tokenizer=tokenizer, eos=_eos_count(meta, fmt)):
        return None
    return meta


def _ids_match(tokens_path: Path, meta: dict, *, tokenizer: TextTokenizer, eos: int) -> bool:
    digest, seen = hashlib.sha256(), 0
    try:
        with open_user_file(tokens_path, what="token cache") as handle:
            while True:
                piece = np.fromfile(handle, dtype=meta["dtype"], count=_SCAN)
                if not piece.size:
                    break
                if int(piece.max()) >= tokenizer.vocab_size:
                    return False
                seen += int(np.count_nonzero(piece == tokenizer.eos_id))
                digest.update(piece.tobytes())
    except (MedleyInputError, OSError, ValueError):
        return False
    return seen >= eos and digest.hexdigest() == meta["sha256"]


def id_dtype(tokenizer: TextTokenizer) -> type:
    """The dtype a cache stores ``tokenizer``'s ids in: uint16 when its vocabulary fits, else uint32."""
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


class _Sink:
    """The ``.tokens`` file being written: ids in the cache's dtype, counted and hashed. A failed
    write (a full disk: its OSError names no file) is one line naming the cache."""

    def __init__(self, handle: BinaryIO, *, path: Path, dtype: type) -> None:
        self.handle, self.path, self.dtype = handle, path, dtype
        self.digest, self.tokens, self.text_tokens = hashlib.sha256(), 0, 0

    def write(self, ids: np.ndarray | list[int], *, text: bool = True) -> None:
        raw = np.asarray(ids, dtype=self.dtype).tobytes()
        try:
            self.handle.write(raw)
        except OSError as err:
            raise MedleyInputError(os_error_message(self.path, err)) from None
        self.digest.update(raw)
        count = len(raw) // np.dtype(self.dtype).itemsize
        self.tokens += count
        self.text_tokens += count if text else 0


def _host_prefix(tokens_path: Path) -> str:
    """``.<key>.tokens.<host>-``: the temporary files of this host's builds start so, then the
    building process's pid, so a later build can remove those of dead processes (a build killed
    outright, as by the out-of-memory killer, cannot remove its own)."""
    return f".{tokens_path.name}.{_host()}-"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:64]


def _remove_stale(cache_dir: Path) -> None:
    """Remove the temporary files of this host's builds whose process is gone."""
    marker = f".tokens.{_host()}-"
    for tmp in cache_dir.glob(f".*{marker}*.tmp"):
        pid = tmp.name.rpartition(marker)[2].partition(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _build(path: Path, fmt: str, *, tokenizer: TextTokenizer, field: str, tokens_path: Path, meta_path: Path,
           flag: str) -> None:
    dtype = id_dtype(tokenizer)
    try:
        tokens_path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(tokens_path.parent)
        prefix = f"{_host_prefix(tokens_path)}{os.getpid()}."
        fd, tmp = tempfile.mkstemp(dir=tokens_path.parent, prefix=prefix, suffix=".tmp")
    except OSError as err:
        raise MedleyInputError(f"--data-cache {tokens_path.parent}: cannot write ({err.strerror}); choose "
                               "another --data-cache") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            sink = _Sink(handle, path=tokens_path, dtype=dtype)
            documents_read = _write_tokens(path, fmt, sink, tokenizer=tokenizer, field=field, flag=flag)
            try:
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as err:
                raise MedleyInputError(os_error_message(tokens_path, err)) from None
        os.replace(tmp, tokens_path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise MedleyInputError(os_error_message(tokens_path, err)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    meta = {"version": CACHE_VERSION, "source": str(path), "format": fmt, "field": field,
            "tokenizer": str(tokenizer.path), "dtype": np.dtype(dtype).name, "tokens": sink.tokens,
            "text_tokens": sink.text_tokens, "documents": documents_read, "sha256": sink.digest.hexdigest()}
    try:
        write_atomically(meta_path, json.dumps(meta, indent=1) + "\n")
    except BaseException:
        tokens_path.unlink(missing_ok=True)  # no .tokens without its .json
        raise


def _write_tokens(path: Path, fmt: str, sink: _Sink, *, tokenizer: TextTokenizer, field: str,
                  flag: str) -> int:
    """Stream the documents' ids into ``sink``, each followed by EOS (plain text: one document);
    returns the number of documents."""
    eos = [tokenizer.eos_id]
    if fmt == "text":  # one document, read in pieces
        for ids in encode_long(tokenizer.tokenizer, documents(path, fmt, field=field, flag=flag)):
            sink.write(ids)
        if sink.tokens:
            sink.write(eos, text=False)
        return 1
    batch: list[str] = []
    chars = docs = 0

    def flush() -> None:
        nonlocal chars
        for encoding in tokenizer.tokenizer.encode_batch(batch, add_special_tokens=False):
            sink.write(encoding.ids)
            sink.write(eos, text=False)
        batch.clear()
        chars = 0

    for text in documents(path, fmt, field=field, flag=flag):
        docs += 1
        if len(text) > _LONG:  # in windows, in bounded memory
            flush()
            for ids in encode_long(tokenizer.tokenizer, pieces_of(text)):
                sink.write(ids)
            sink.write(eos, text=False)
            continue
        batch.append(text)
        chars += len(text)
        if len(batch) == _BATCH_DOCS or chars >= _BATCH_CHARS:
            flush()
    flush()
    return docs
