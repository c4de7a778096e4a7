"""Instruction data as examples: one conversation or prompt/completion pair per row of the batch,
its loss on the learned tokens only (:mod:`.chat` says which).

Unpacked (``--pack`` is :mod:`.packing`): an example is one sequence, cut to its first
``seq_len + 1`` tokens (the rest is dropped, and counted) and padded on the right with the
tokenizer's pad token (its EOS when it has none). Attention is causal, so padding after an
example changes none of its positions, and the padded targets, like the prompt's, carry
:data:`IGNORE` and add nothing to the loss. The loss of a step is the sum over its learned
targets divided by their number in the global batch: the mean over unmasked tokens, whatever
the plan (each micro-batch's sum is divided by the global count, which every rank knows since
every rank draws the global batch). An example with no learned target in its first ``seq_len +
1`` tokens is left out of the order (and counted).

The examples are tokenized once, in the launching process, into a cache like the text cache
(:mod:`.cache`): ``<key>.ids`` (uint16 or uint32), ``<key>.mask`` (uint8), ``<key>.offsets``
(int64, one more than the examples), ``<key>.first`` (int64 per example: the position of its
first learned token, -1 for none, so that ranks choose the usable examples without reading the
mask) and ``<key>.examples.json`` (counts and sha256 of the four, written last, so a cache is
whole or absent). The key hashes the input files (path, size,
modification time), the tokenizer, the chat template and the kind of data; ranks map the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from medley.data.cache import TextTokenizer, id_dtype
from medley.data.chat import ChatTemplate, encode_conversation, encode_pair
from medley.data.formats import input_files, records
from medley.errors import MedleyInputError
from medley.fileio import check_regular_file, open_user_file, os_error_message, write_atomically

KINDS = ("auto", "text", "chat", "completion")
IGNORE = -100  # F.cross_entropy's ignore_index, and transformers' label for "no loss"
EXAMPLES_VERSION = 2
_FIELDS = ("messages", "prompt", "completion")
_PARTS = ("ids", "mask", "offsets", "first")
_SCAN = 1 << 22  # elements hashed at a time when verifying a cache


def data_kind(path: Path, fmt: str, *, kind: str, text_field: str, flag: str) -> str:
    """``text``, ``chat`` or ``completion``: ``kind`` unless ``auto``, which reads the first row:
    a ``messages`` field makes conversations, ``prompt`` and ``completion`` pairs, else text."""
    if kind not in KINDS:
        raise MedleyInputError(f"--data-format '{kind}' must be one of {', '.join(KINDS)}")
    if kind != "auto":
        return kind
    if fmt not in ("jsonl", "parquet", "arrow"):
        return "text"
    for _, row in records(path, fmt, fields=(*_FIELDS, text_field), flag=flag):
        if "messages" in row and text_field not in row:
            return "chat"
        if "prompt" in row and "completion" in row and text_field not in row:
            return "completion"
        return "text"
    return "text"


@dataclass(frozen=True, kw_only=True)
class Examples:
    """The usable examples of a tokenized instruction data set, in their sequences.

    Attributes:
        ids: every example's token ids, one after the other (a memory map).
        mask: 1 where the token is learned, per id.
        offsets: example ``e`` is ``ids[offsets[e]:offsets[e + 1]]``.
        order: the examples used (at least one learned target in their first ``seq_len + 1``
            tokens), in file order; sample ``i`` of this run is example ``order[i]``.
        seq_len: tokens per sequence (a row holds ``seq_len + 1``).
        pad_id: the id padding a short example.
    """

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    order: np.ndarray
    seq_len: int
    pad_id: int

    @property
    def count(self) -> int:
        return len(self.order)

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples ``indices`` (of :attr:`order`) as [n, seq_len + 1] ids and [n, seq_len]
        targets (the next id where it is learned, else :data:`IGNORE`)."""
        width = self.seq_len + 1
        tokens = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        learned = np.zeros((len(indices), width), dtype=bool)
        for row, index in enumerate(indices):
            example = int(self.order[int(index)])
            lo, hi = int(self.offsets[example]), int(self.offsets[example + 1])
            n = min(hi - lo, width)
            tokens[row, :n] = self.ids[lo:lo + n]
            learned[row, :n] = self.mask[lo:lo + n] != 0
        targets = np.where(learned[:, 1:], tokens[:, 1:], IGNORE)
        return torch.from_numpy(tokens), torch.from_numpy(targets)

    def in_order(self, batch: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``batch`` of the examples taken in order (wrapping around): evaluation batches."""
        return self.rows([(batch * sequences + r) % self.count for r in range(sequences)])

    def part(self, lo: int, hi: int) -> Examples:
        return Examples(ids=self.ids, mask=self.mask, offsets=self.offsets, order=self.order[lo:hi],
                        seq_len=self.seq_len, pad_id=self.pad_id)


def usable(first: np.ndarray, offsets: np.ndarray, *, seq_len: int) -> tuple[np.ndarray, int]:
    """The examples with a learned target in their first ``seq_len + 1`` tokens (``first``: each
    one's first learned position, -1 for none; position 0 is never a target), and how many
    examples are longer than that (cut)."""
    first = np.asarray(first)
    lengths = np.diff(np.asarray(offsets))
    return np.flatnonzero((first >= 1) & (first <= seq_len)), int(np.count_nonzero(lengths > seq_len + 1))


def cache_key(path: Path, fmt: str, *, kind: str, tokenizer: TextTokenizer,
              template: ChatTemplate | None) -> str:
    files = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in input_files(path, fmt)]
    spec = {"version": EXAMPLES_VERSION, "files": files, "kind": kind, "tokenizer": tokenizer.digest,
            "template": None if template is None else template.digest}
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:24]


def cached_examples(path: Path, fmt: str, *, kind: str, tokenizer: TextTokenizer,
                    template: ChatTemplate | None, cache_dir: Path, flag: str,
                    verify: bool = True) -> tuple[dict[str, np.ndarray], str]:
    """``ids``, ``mask`` and ``offsets`` of the data set's examples, memory-mapped from the
    cache (built now when absent or not whole; ``verify`` also checks the recorded hashes), and
    a fingerprint of their contents."""
    key = cache_key(path, fmt, kind=kind, tokenizer=tokenizer, template=template)
    paths = {part: cache_dir / f"{key}.{part}" for part in _PARTS}
    meta_path = cache_dir / f"{key}.examples.json"
    found = _read_cache(paths, meta_path, vocab_size=tokenizer.vocab_size, verify=verify)
    if found is None:
        _build(path, fmt, kind=kind, tokenizer=tokenizer, template=template, paths=paths, meta_path=meta_path,
               flag=flag)
        found = _read_cache(paths, meta_path, vocab_size=tokenizer.vocab_size, verify=False)
        if found is None:
            raise MedleyInputError(f"--data-cache {meta_path}: the example cache just built does not read "
                                   "back whole (another process writing it?); run again or choose another "
                                   "--data-cache")
    arrays, meta = found
    if len(arrays["offsets"]) < 2:
        raise MedleyInputError(f"{flag} {path}: no examples in it; give a data set with rows")
    digest = hashlib.sha256("".join(str(meta[f"sha256_{part}"]) for part in _PARTS).encode()).hexdigest()
    return arrays, f"{kind}:{digest[:16]}"


def _read_cache(paths: dict[str, Path], meta_path: Path, *, vocab_size: int, verify: bool
                ) -> tuple[dict[str, np.ndarray], dict] | None:
    """The cache's arrays when its ``.json`` reads back with the fields written and each file
    has the size it records (with ``verify``, the sha256 too, and ids inside the vocabulary)."""
    try:
        with open_user_file(meta_path, what="example cache index") as handle:
            meta = json.loads(handle.read(1 << 20))
        if not isinstance(meta, dict) or meta.get("version") != EXAMPLES_VERSION:
            return None
        tokens, examples = int(meta["tokens"]), int(meta["examples"])
        dtypes = {"ids": str(meta["dtype"]), "mask": "uint8", "offsets": "int64", "first": "int64"}
        sizes = {"ids": tokens, "mask": tokens, "offsets": examples + 1, "first": examples}
        arrays = {}
        for part, path in paths.items():
            check_regular_file(path, what="example cache")
            if path.stat().st_size != sizes[part] * np.dtype(dtypes[part]).itemsize:
                return None
            arrays[part] = np.memmap(path, dtype=dtypes[part], mode="r", shape=(sizes[part],)) \
                if sizes[part] else np.zeros(0, dtype=dtypes[part])
    except (MedleyInputError, OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if verify:
        for part, array in arrays.items():
            digest = hashlib.sha256()
            for start in range(0, len(array), _SCAN):  # in pieces: never a copy of the whole file
                digest.update(np.ascontiguousarray(array[start:start + _SCAN]).tobytes())
            if digest.hexdigest() != meta.get(f"sha256_{part}"):
                return None
        offsets = arrays["offsets"]
        top = max((int(arrays["ids"][s:s + _SCAN].max()) for s in range(0, tokens, _SCAN)), default=0)
        if top >= vocab_size or int(offsets[0]) != 0 or int(offsets[-1]) != tokens \
                or bool(np.any(np.diff(offsets) < 0)):
            return None
    return arrays, meta


def _encoded(path: Path, fmt: str, *, kind: str, tokenizer: TextTokenizer, template: ChatTemplate | None,
             flag: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for where, row in records(path, fmt, fields=_FIELDS, flag=flag):
        if kind == "chat":
            if "messages" not in row:
                raise MedleyInputError(f"{where}: no 'messages' field; give conversations or --data-format")
            assert template is not None
            yield encode_conversation(row["messages"], template=template, tokenizer=tokenizer.tokenizer,
                                      where=where)
        else:
            if "prompt" not in row or "completion" not in row:
                raise MedleyInputError(f"{where}: needs 'prompt' and 'completion' fields; give pairs or "
                                       "--data-format")
            yield encode_pair(row["prompt"], row["completion"], tokenizer=tokenizer.tokenizer,
                              eos_id=tokenizer.eos_id, where=where)


def _build(path: Path, fmt: str, *, kind: str, tokenizer: TextTokenizer, template: ChatTemplate | None,
           paths: dict[str, Path], meta_path: Path, flag: str) -> None:
    cache_dir = meta_path.parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = {}
        for part in _PARTS:
            fd, name = tempfile.mkstemp(dir=cache_dir, prefix=f".{paths[part].name}.", suffix=".tmp")
            os.close(fd)
            tmp[part] = Path(name)
    except OSError as err:
        raise MedleyInputError(f"--data-cache {cache_dir}: cannot write ({err.strerror}); choose another "
                               "--data-cache") from None
    digests = {part: hashlib.sha256() for part in _PARTS}
    dtype = np.dtype(id_dtype(tokenizer)).name
    try:
        with open(tmp["ids"], "wb") as ids_file, open(tmp["mask"], "wb") as mask_file:
            offsets, first, total = [0], [], 0
            encoded = _encoded(path, fmt, kind=kind, tokenizer=tokenizer, template=template, flag=flag)
            for ids, mask in encoded:
                for part, handle, raw in (("ids", ids_file, ids.astype(dtype).tobytes()),
                                          ("mask", mask_file, mask.tobytes())):
                    handle.write(raw)
                    digests[part].update(raw)
                total += len(ids)
                offsets.append(total)
                learned = np.flatnonzero(mask[1:])
                first.append(int(learned[0]) + 1 if learned.size else -1)
            for handle in (ids_file, mask_file):
                handle.flush()
                os.fsync(handle.fileno())
        for part, values in (("offsets", offsets), ("first", first)):
            raw = np.asarray(values, dtype=np.int64).tobytes()
            digests[part].update(raw)
            Path(tmp[part]).write_bytes(raw)
        for part in _PARTS:
            os.replace(tmp[part], paths[part])
    except OSError as err:
        raise MedleyInputError(os_error_message(paths["ids"], err)) from None
    finally:
        for part in _PARTS:
            Path(tmp[part]).unlink(missing_ok=True)
    meta = {"version": EXAMPLES_VERSION, "source": str(path), "kind": kind, "dtype": dtype, "tokens": total,
            "examples": len(offsets) - 1, "template": None if template is None else template.source,
            **{f"sha256_{part}": digests[part].hexdigest() for part in _PARTS}}
    write_atomically(meta_path, json.dumps(meta, indent=1) + "\n")
