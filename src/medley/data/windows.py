"""Sequences cut from a token array: non-overlapping windows of ``seq_len + 1`` tokens.

Window ``i`` of a :class:`Windows` is ``tokens[(first + i) * seq_len : (first + i + 1) * seq_len + 1]``:
inputs and shifted targets, consecutive windows sharing one boundary token. Training draws
windows through a seeded permutation per epoch (:func:`sample_order`), a pure function of the
seed and the sample index, so the global batch of a step never depends on the plan and a resumed
run continues at the exact next sample.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_EPOCH_SEED = 1_000_003


@dataclass(frozen=True, kw_only=True)
class Windows:
    """A run of windows of one token array.

    Attributes:
        tokens: the token ids (a numpy memmap or array; only the rows asked for are read).
        seq_len: tokens per sequence (a window holds ``seq_len + 1``).
        first: index of the first window of this run in the array.
        count: windows in this run.
    """

    tokens: np.ndarray
    seq_len: int
    first: int
    count: int

    def rows(self, indices: Sequence[int]) -> torch.Tensor:
        """Windows ``indices`` (of this run) as a [len(indices), seq_len + 1] int64 tensor."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices):
            start = (self.first + int(index)) * self.seq_len
            out[row] = self.tokens[start:start + self.seq_len + 1]
        return torch.from_numpy(out)

    def in_order(self, batch: int, sequences: int) -> torch.Tensor:
        """Batch ``batch`` of the windows taken in order (wrapping around): evaluation batches."""
        return self.rows([(batch * sequences + r) % self.count for r in range(sequences)])


def window_count(tokens: int, seq_len: int) -> int:
    """Non-overlapping windows of ``seq_len + 1`` tokens in ``tokens`` tokens."""
    return max(0, (tokens - 1) // seq_len)


def held_out(total: int, val_fraction: float) -> int:
    """How many of ``total`` samples (the last ones) ``val_fraction`` holds out: at least one
    when it is above 0."""
    return max(1, int(round(total * val_fraction))) if val_fraction > 0 else 0


def split_windows(tokens: np.ndarray, *, seq_len: int, val_fraction: float) -> tuple[Windows, Windows | None]:
    """All windows of ``tokens`` for training, or the last ``val_fraction`` of them held out."""
    total = window_count(len(tokens), seq_len)
    held = held_out(total, val_fraction)
    train = Windows(tokens=tokens, seq_len=seq_len, first=0, count=total - held)
    val = Windows(tokens=tokens, seq_len=seq_len, first=total - held, count=held) if held else None
    return train, val


@functools.lru_cache(maxsize=4)
def _permutation(count: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * _EPOCH_SEED + epoch)
    dtype = torch.int32 if count < 2**31 else torch.int64
    return torch.randperm(count, generator=gen, dtype=dtype)


def sample_order(*, count: int, seed: int, first_sample: int, samples: int) -> list[int]:
    """Window indices of samples ``first_sample .. first_sample + samples - 1``: epoch after
    epoch, each a seeded permutation of the ``count`` windows."""
    out = []
    for sample in range(first_sample, first_sample + samples):
        epoch, position = divmod(sample, count)
        out.append(int(_permutation(count, seed, epoch)[position]))
    return out
