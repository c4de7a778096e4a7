"""Packed instruction data (``--pack``): examples placed one after the other in each sequence,
attention and positions reset per example.

An example of ``n`` tokens fills ``w = min(n - 1, seq_len)`` positions: its first ``w`` ids as
inputs, the next ``w`` as targets where learned (the unpacked row has the same inputs and
targets, then padding that learns nothing). Examples go into sequences as the sample order
gives them, a new sequence starting when the next one does not fit (next-fit, as torchtune's
``PackedDataset`` without splitting an example); the rest of a sequence is padding. Each
position carries its example's index in the sequence (:attr:`PackedRows.segments`; padding one
more): the model attends only inside a segment and counts positions from its start
(:mod:`medley.runtime.transformer`), so an example's losses are those it has alone.

Sequence ``r`` of a run is a pure function of the examples, the seed and ``r``: where each
sequence starts in the sample order is found by one pass over that order, kept as it grows
(a resume at step ``k`` passes over the samples of the first ``k`` steps once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from medley.data.examples import IGNORE, Examples
from medley.data.windows import sample_order


@dataclass(frozen=True, kw_only=True)
class PackedRows:
    """Sequences of packed examples.

    Attributes:
        tokens: [n, seq_len + 1] ids: the inputs in the first ``seq_len`` columns, padding after.
        targets: [n, seq_len] next ids where learned, else :data:`IGNORE`.
        segments: [n, seq_len] each position's example within its sequence (0, 1, ...), the
            padding after the last one more.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor


@dataclass(kw_only=True)
class PackStats:
    """How full packed sequences are, over one pass of the examples.

    Attributes:
        examples: examples packed.
        sequences: sequences they fill.
        positions: input positions the examples fill.
        seq_len: positions per sequence.
    """

    examples: int
    sequences: int
    positions: int
    seq_len: int

    @property
    def efficiency(self) -> float:
        """Share of packed positions holding an example."""
        return self.positions / (self.sequences * self.seq_len)

    @property
    def unpacked_efficiency(self) -> float:
        """The same share with one example per sequence."""
        return self.positions / (self.examples * self.seq_len)

    def describe(self) -> str:
        return (f"packed {self.examples:,} examples into {self.sequences:,} sequences of {self.seq_len} "
                f"({self.efficiency:.0%} of positions hold tokens, {1 - self.efficiency:.0%} padding; "
                f"one per sequence: {self.unpacked_efficiency:.0%}, "
                f"{self.examples / self.sequences:.1f}x fewer sequences per epoch)")


@dataclass(kw_only=True)
class Packer:
    """Packs ``examples`` (in the order a seed draws them, or in file order) into sequences.

    Attributes:
        examples: the examples.
        shuffled: draw them through :func:`medley.data.windows.sample_order` (training); else
            in order, wrapping around (validation).
    """

    examples: Examples
    shuffled: bool = True
    _starts: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _widths: np.ndarray | None = field(default=None, repr=False)
    _epochs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _stats: dict[int, PackStats] = field(default_factory=dict, repr=False)

    @property
    def widths(self) -> np.ndarray:
        """Positions each used example fills (index of :attr:`Examples.order`)."""
        if self._widths is None:
            ex = self.examples
            lengths = np.diff(np.asarray(ex.offsets))[np.asarray(ex.order)]
            self._widths = np.minimum(lengths - 1, ex.seq_len).astype(np.int64)
        return self._widths

    def _epoch(self, seed: int, epoch: int) -> np.ndarray:
        """The used-example index of each sample of ``epoch``."""
        key = (seed, epoch)
        if key not in self._epochs:
            count = self.examples.count
            if self.shuffled:
                order = sample_order(count=count, seed=seed, first_sample=epoch * count, samples=count)
            else:
                order = range(count)
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[key] = np.asarray(order, dtype=np.int64)
        return self._epochs[key]

    def samples(self, seed: int, first: int, count: int) -> list[int]:
        """The used-example indices of samples ``first .. first + count - 1``."""
        out = []
        for sample in range(first, first + count):
            epoch, position = divmod(sample, self.examples.count)
            out.append(int(self._epoch(seed, epoch)[position]))
        return out

    def starts(self, seed: int, rows: int) -> list[int]:
        """The first sample of sequences ``0 .. rows`` (``rows + 1`` entries: the last ends the
        sequence before it)."""
        starts = self._starts.setdefault(seed, [0])
        widths, seq_len, count = self.widths, self.examples.seq_len, self.examples.count
        sample, used = starts[-1], 0
        while len(starts) <= rows:
            epoch, position = divmod(sample, count)
            width = int(widths[self._epoch(seed, epoch)[position]])
            if used + width > seq_len:
                starts.append(sample)
                used = 0
            used += width
            sample += 1
        return starts

    def rows(self, seed: int, first_row: int, count: int) -> PackedRows:
        """Packed sequences ``first_row .. first_row + count - 1``."""
        ex = self.examples
        starts = self.starts(seed, first_row + count)
        width = ex.seq_len
        tokens = np.full((count, width + 1), ex.pad_id, dtype=np.int64)
        targets = np.full((count, width), IGNORE, dtype=np.int64)
        segments = np.empty((count, width), dtype=np.int64)
        for row in range(count):
            lo, hi = starts[first_row + row], starts[first_row + row + 1]
            at = 0
            for segment, index in enumerate(self.samples(seed, lo, hi - lo)):
                example = int(ex.order[index])
                start, w = int(ex.offsets[example]), int(self.widths[index])
                ids = np.asarray(ex.ids[start:start + w + 1], dtype=np.int64)
                learned = np.asarray(ex.mask[start + 1:start + w + 1]) != 0
                tokens[row, at:at + w] = ids[:w]
                targets[row, at:at + w] = np.where(learned, ids[1:], IGNORE)
                segments[row, at:at + w] = segment
                at += w
            segments[row, at:] = hi - lo
        return PackedRows(tokens=torch.from_numpy(tokens), targets=torch.from_numpy(targets),
                          segments=torch.from_numpy(segments))

    def stats(self, seed: int) -> PackStats:
        """How one epoch's examples (as ``seed`` orders them) fill sequences (one pass, kept)."""
        if seed in self._stats:
            return self._stats[seed]
        widths, seq_len = self.widths, self.examples.seq_len
        order = self.samples(seed, 0, self.examples.count)
        sequences, used = 1, 0
        for index in order:
            width = int(widths[index])
            if used + width > seq_len:
                sequences, used = sequences + 1, 0
            used += width
        self._stats[seed] = PackStats(examples=self.examples.count, sequences=sequences,
                                      positions=int(widths.sum()), seq_len=seq_len)
        return self._stats[seed]
