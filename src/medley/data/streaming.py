"""Tokenizing a long document in bounded memory, with the ids whole-document encoding gives.

``tokenizers`` keeps several objects per token (id, offsets, string, masks), so encoding a
20 MB document at once took 3.4 GB. Here the text is cut into windows of about ``WINDOW``
characters that overlap by ``MARGIN`` on each side of each cut; the windows are encoded (a
batch at a time, in parallel) and stitched: the tokens left of a cut come from the window
before it, those right of it from the window after. Cuts are put where a whitespace run starts
(a word boundary for byte-level, Metaspace and SentencePiece tokenizers alike) and kept only
where the two windows agree: the same tokens, offsets included, over ``ZONE`` characters each
side of the cut, none of them across it. Tokenizers look at a few characters of context, so far
from the windows' own ends both give what the whole document gives. Where they disagree (a run
longer than the margin without whitespace, a tokenizer with wider context) the window grows
past the cut instead, up to ``MAX_SPAN`` characters; only a document that stays ambiguous that
long is cut there anyway, which may change the tokens next to that one cut.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

WINDOW = 1 << 16  # characters a window is responsible for
MARGIN = 1 << 11  # characters of context beyond each cut
ZONE = MARGIN // 2  # characters each side of a cut over which two windows must agree
BATCH = min(8, os.cpu_count() or 1)  # windows per encode_batch call (in parallel): ~8 MB each
MAX_SPAN = 1 << 22  # longest window grown when cuts keep disagreeing
_RUN_START = re.compile(r"\s(?=\S)")  # in reversed text: the first character of a whitespace run


@dataclass(frozen=True, kw_only=True)
class _Encoded:
    """The tokens of the text ``[lo, hi)`` of the document: ids and absolute character offsets."""

    lo: int
    hi: int
    ids: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


class _Text:
    """A document arriving in pieces, buffered from absolute character ``start`` on."""

    def __init__(self, pieces: Iterable[str]) -> None:
        self._pieces = iter(pieces)
        self.buffer, self.start, self.done = "", 0, False

    @property
    def end(self) -> int:
        return self.start + len(self.buffer)

    def fill(self, upto: int) -> None:
        """Read pieces until the buffer reaches ``upto`` or the document ends."""
        parts, end = [self.buffer], self.end
        while end < upto and not self.done:
            piece = next(self._pieces, None)
            if piece is None:
                self.done = True
            else:
                parts.append(piece)
                end += len(piece)
        self.buffer = "".join(parts)

    def get(self, lo: int, hi: int) -> str:
        return self.buffer[lo - self.start:hi - self.start]

    def forget(self, before: int) -> None:
        """Drop the text before ``before`` (no window will read it again)."""
        if before > self.start:
            self.buffer, self.start = self.buffer[before - self.start:], before


def _encode(tokenizer: Tokenizer, text: _Text, spans: list[tuple[int, int]]) -> list[_Encoded]:
    encodings = tokenizer.encode_batch([text.get(lo, hi) for lo, hi in spans], add_special_tokens=False)
    out = []
    for (lo, hi), encoding in zip(spans, encodings, strict=True):
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + lo
        out.append(_Encoded(lo=lo, hi=hi, ids=np.asarray(encoding.ids, dtype=np.int64), starts=offsets[:, 0],
                            ends=offsets[:, 1]))
    return out


def _cut(text: _Text, target: int) -> int:
    """Where a whitespace run starts, at or before ``target`` (in its last quarter window), else
    ``target`` itself."""
    lo = max(text.start + 1, target - WINDOW // 4)
    found = _RUN_START.search(text.get(lo, target + 1)[::-1])
    return target - found.start() if found else target


def _split(left: _Encoded, right: _Encoded, cut: int) -> int | None:
    """The first token start at or after ``cut`` where ``left`` and ``right`` agree (the same
    tokens over the zone around the cut, none of ``left``'s crossing it), or None."""
    zone = cut - ZONE, cut + ZONE
    a = slice(*np.searchsorted(left.starts, zone))
    b = slice(*np.searchsorted(right.starts, zone))
    if not (np.array_equal(left.ids[a], right.ids[b]) and np.array_equal(left.starts[a], right.starts[b])
            and np.array_equal(left.ends[a], right.ends[b])):
        return None
    at = np.searchsorted(left.starts[a], cut)
    if at == len(left.starts[a]):
        return None
    split = int(left.starts[a][at])
    before = left.ends[left.starts < split]
    return split if not len(before) or int(before.max()) <= split else None


def encode_long(tokenizer: Tokenizer, pieces: Iterable[str]) -> Iterator[np.ndarray]:
    """The ids of the document whose text ``pieces`` are, in order, a window at a time (int64
    arrays). Memory stays within a few windows whatever the document's length."""
    text = _Text(pieces)
    pending: _Encoded | None = None  # encoded, its tokens from `emitted` on not yet given
    emitted, next_cut = 0, 0
    while True:
        spans, cuts = [], []
        while len(spans) < BATCH:
            text.fill(next_cut + WINDOW + 2 * MARGIN)
            if text.done and text.end <= next_cut + WINDOW + MARGIN:
                spans.append((max(0, next_cut - MARGIN), text.end))
                cuts.append(next_cut)
                next_cut = text.end
                break
            cut = _cut(text, next_cut + WINDOW)
            spans.append((max(0, next_cut - MARGIN), cut + MARGIN))
            cuts.append(next_cut)
            next_cut = cut
        if not spans:
            break
        for window, cut in zip(_encode(tokenizer, text, spans), cuts, strict=True):
            if pending is None:
                pending = window
                continue
            split = _split(pending, window, cut)
            if split is None and window.hi - pending.lo <= MAX_SPAN:
                pending = _encode(tokenizer, text, [(pending.lo, window.hi)])[0]  # grow past the cut
                continue
            split = cut if split is None else split
            yield pending.ids[(pending.starts >= emitted) & (pending.starts < split)]
            emitted, pending = split, window
        text.forget(pending.lo)
        if next_cut >= text.end and text.done:
            break
    if pending is not None:
        yield pending.ids[pending.starts >= emitted]


def pieces_of(text: str) -> Iterator[str]:
    """``text`` in pieces of ``WINDOW`` characters, for :func:`encode_long`."""
    return (text[i:i + WINDOW] for i in range(0, len(text), WINDOW))
