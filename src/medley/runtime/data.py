"""Training data: a byte-level tokenizer over a text file, or a synthetic source.

The global batch of step ``k`` is a pure function of (source, seed, k, batch shape): the same
sequences whatever the plan, so two plans with the same seed see the same data step by step and
the data position of a checkpoint is just the step. Replicas take disjoint, consecutive slices
of it, sized by their micro-batch counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from medley.errors import MedleyInputError
from medley.runtime.executor import MicroBatches

VOCAB_SIZE = 256
SHIPPED_CORPUS = "corpus.txt"
SYNTHETIC = "synthetic"


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as token ids (vocabulary 256: one id per byte value)."""
    data = text.encode("utf-8")
    if not data:  # torch.frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """Where sequences come from.

    Attributes:
        name: ``synthetic``, ``shipped:corpus.txt`` or the text file's path.
        tokens: the whole corpus as byte ids (empty for the synthetic source).
        fingerprint: short hash of the source, stored in checkpoints to catch a changed ``--data``.
    """

    name: str
    tokens: torch.Tensor
    fingerprint: str

    @property
    def synthetic(self) -> bool:
        return self.name == SYNTHETIC

    def global_batch(self, *, step: int, seed: int, sequences: int, seq_len: int) -> torch.Tensor:
        """``sequences`` rows of ``seq_len + 1`` token ids (inputs and shifted targets) for ``step``."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if self.synthetic:
            # Byte sequences with a per-row start and stride: learnable, unlike uniform noise.
            start = torch.randint(0, VOCAB_SIZE, (sequences, 1), generator=gen)
            stride = torch.randint(1, 8, (sequences, 1), generator=gen)
            return (start + stride * torch.arange(seq_len + 1)) % VOCAB_SIZE
        offsets = torch.randint(0, len(self.tokens) - seq_len - 1, (sequences,), generator=gen)
        return torch.stack([self.tokens[o:o + seq_len + 1] for o in offsets.tolist()])


def load_source(data: str | Path | None, *, seq_len: int) -> DataSource:
    """The shipped corpus (``None``), the synthetic source (``"synthetic"``) or a UTF-8 text file."""
    if data == SYNTHETIC:
        return DataSource(name=SYNTHETIC, tokens=torch.empty(0, dtype=torch.long), fingerprint=SYNTHETIC)
    if data is None:
        text = resources.files("medley.data").joinpath(SHIPPED_CORPUS).read_text(encoding="utf-8")
        name = f"shipped:{SHIPPED_CORPUS}"
    else:
        try:
            text = Path(data).read_text(encoding="utf-8")
        except OSError as err:
            raise MedleyInputError(
                f"--data {data}: cannot read the file ({err.strerror}); check the path") from None
        except UnicodeDecodeError:
            raise MedleyInputError(
                f"--data {data}: not UTF-8 text; give a text file or 'synthetic'") from None
        name = str(data)
    tokens = encode(text)
    if len(tokens) < 2 * (seq_len + 1):
        what = "is empty" if not len(tokens) else f"has {len(tokens)} bytes, too few"
        raise MedleyInputError(
            f"--data {name}: {what} for sequences of {seq_len} tokens (at least {2 * (seq_len + 1)} bytes); "
            "give a longer text or a shorter --seq-len")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return DataSource(name=name, tokens=tokens, fingerprint=digest)


def replica_slice(tokens: torch.Tensor, *, micro_batches: Sequence[int], micro_batch_size: int,
                  replica: int) -> MicroBatches:
    """Replica ``replica``'s consecutive rows of the global batch, cut into its micro-batches."""
    start = sum(micro_batches[:replica]) * micro_batch_size
    rows = tokens[start:start + micro_batches[replica] * micro_batch_size]
    chunks = rows.split(micro_batch_size)
    return MicroBatches(inputs=[c[:, :-1] for c in chunks], targets=[c[:, 1:] for c in chunks])
