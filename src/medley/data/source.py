"""Data sources: where the global batch of each step, and the validation batches, come from.

The global batch of step ``k`` is a pure function of (source, seed, k, batch shape): the same
sequences whatever the plan, so two plans with the same seed see the same data step by step and
the data position of a checkpoint is just the step. Replicas take disjoint, consecutive slices
of it, sized by their micro-batch counts (:func:`replica_slice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from medley.data.examples import IGNORE, Examples
from medley.data.packing import Packer
from medley.data.windows import Windows, sample_order


@dataclass(kw_only=True)
class MicroBatches:
    """This replica's token ids and targets, one [micro_batch_size, seq] tensor per micro-batch.

    Attributes:
        inputs: token ids per micro-batch.
        targets: the next token per position, -100 where the loss does not count.
        loss_tokens: learned targets in the whole global batch (every replica's): each
            micro-batch's summed loss is divided by it, so the losses of the step add up to the
            mean over the global batch.
        segments: packed data: each position's example within its sequence, per micro-batch
            (:mod:`.packing`); None: one example (or text window) per sequence.
    """

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    loss_tokens: int
    segments: list[torch.Tensor] | None = None


BYTE_VOCAB = 256
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
class Rows:
    """Sequences of a batch and what each position learns.

    Attributes:
        tokens: [sequences, seq_len + 1] token ids.
        targets: [sequences, seq_len]: the next token where the loss counts, else ``IGNORE``
            (-100, the value ``F.cross_entropy`` and transformers skip); text data learns every
            position (``tokens[:, 1:]``), instruction data the assistant's or completion's tokens.
        segments: [sequences, seq_len]: packed data's example index per position
            (:class:`medley.data.packing.PackedRows`); None: not packed.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor) -> Rows:
        """Text rows: every next token is learned."""
        return cls(tokens=tokens, targets=tokens[:, 1:])

    @property
    def loss_tokens(self) -> int:
        """Targets the loss counts: the mean loss of the batch divides its sum by this."""
        return int((self.targets != IGNORE).sum())


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """Where sequences come from.

    Attributes:
        name: ``synthetic``, ``shipped:corpus.txt`` or the data's path.
        fingerprint: short hash of the token stream (and of the held-out share), stored in
            checkpoints to catch a changed ``--data``.
        train: the training windows (token sources); None for byte text and synthetic sources.
        val: the validation windows (``--val-fraction`` or ``--val-data``), if any.
        text: byte text sources: the whole text's byte ids (training samples random offsets in
            it, as medley always did), else None.
        examples: instruction data: the training examples (:mod:`.examples`), else None.
        val_examples: instruction data: the validation examples, if any.
        packed: instruction data packed several examples to a sequence (``--pack``,
            :mod:`.packing`), training and validation alike.
        notes: what the launching process says about the data (examples cut or left out).
    """

    name: str
    fingerprint: str
    train: Windows | None = None
    val: Windows | None = None
    text: np.ndarray | None = None
    examples: Examples | None = None
    val_examples: Examples | None = None
    packed: bool = False
    notes: tuple[str, ...] = ()
    _packers: dict[str, Packer] = field(default_factory=dict, repr=False, compare=False)

    def packer(self, which: str = "train") -> Packer:
        """The packer of the ``train`` or ``val`` examples (made once; packed data only)."""
        if which not in self._packers:
            examples = self.examples if which == "train" else self.val_examples
            assert examples is not None
            self._packers[which] = Packer(examples=examples, shuffled=which == "train")
        return self._packers[which]

    def samples_per_epoch(self, seed: int) -> tuple[int, str] | None:
        """How many samples one pass over the training data draws, and what they are (examples,
        packed sequences as the first epoch packs them, windows); None for data sampled at random
        offsets (byte text, synthetic), which has no epochs."""
        if self.examples is not None:
            if self.packed:
                return self.packer().stats(seed).sequences, "packed sequences"
            return self.examples.count, "examples"
        return None if self.train is None else (self.train.count, "windows")

    @property
    def synthetic(self) -> bool:
        return self.name == SYNTHETIC

    def sample_indices(self, *, step: int, seed: int, sequences: int) -> list[int]:
        """Which windows or examples the global batch of ``step`` holds, in order; empty for byte
        text and synthetic data (random offsets, no indices)."""
        samples = self.examples if self.examples is not None else self.train
        if samples is None:
            return []
        if self.packed:
            starts = self.packer().starts(seed, (step + 1) * sequences)
            first, last = starts[step * sequences], starts[(step + 1) * sequences]
            return [int(samples.order[i]) for i in self.packer().samples(seed, first, last - first)]
        return list(sample_order(count=samples.count, seed=seed, first_sample=step * sequences,
                                 samples=sequences))

    def global_rows(self, *, step: int, seed: int, sequences: int, seq_len: int) -> Rows:
        """The global batch of ``step``: ``sequences`` rows and what each position learns."""
        if self.examples is not None:
            if self.examples.seq_len != seq_len:
                raise ValueError(f"the source was cut for seq_len {self.examples.seq_len}, not {seq_len}")
            if self.packed:
                packed = self.packer().rows(seed, step * sequences, sequences)
                return Rows(tokens=packed.tokens, targets=packed.targets, segments=packed.segments)
            order = sample_order(count=self.examples.count, seed=seed, first_sample=step * sequences,
                                 samples=sequences)
            tokens, targets = self.examples.rows(order)
            return Rows(tokens=tokens, targets=targets)
        return Rows.of(self.global_batch(step=step, seed=seed, sequences=sequences, seq_len=seq_len))

    def eval_rows(self, index: int, *, sequences: int) -> Rows:
        """Validation batch ``index``: the validation windows or examples in order."""
        if self.val_examples is not None:
            if self.packed:
                packed = self.packer("val").rows(0, index * sequences, sequences)
                return Rows(tokens=packed.tokens, targets=packed.targets, segments=packed.segments)
            tokens, targets = self.val_examples.in_order(index, sequences)
            return Rows(tokens=tokens, targets=targets)
        return Rows.of(self.eval_batch(index, sequences=sequences))

    def global_batch(self, *, step: int, seed: int, sequences: int, seq_len: int) -> torch.Tensor:
        """``sequences`` rows of ``seq_len + 1`` token ids (inputs and shifted targets) for ``step``."""
        if self.examples is not None:
            return self.global_rows(step=step, seed=seed, sequences=sequences, seq_len=seq_len).tokens
        if self.train is not None:
            if self.train.seq_len != seq_len:
                raise ValueError(f"the source was cut for seq_len {self.train.seq_len}, not {seq_len}")
            return self.train.rows(sample_order(count=self.train.count, seed=seed,
                                                first_sample=step * sequences, samples=sequences))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if self.synthetic:
            # Byte sequences with a per-row start and stride: learnable, unlike uniform noise.
            start = torch.randint(0, BYTE_VOCAB, (sequences, 1), generator=gen)
            stride = torch.randint(1, 8, (sequences, 1), generator=gen)
            return (start + stride * torch.arange(seq_len + 1)) % BYTE_VOCAB
        assert self.text is not None
        offsets = torch.randint(0, len(self.text) - seq_len - 1, (sequences,), generator=gen)
        rows = np.stack([self.text[o:o + seq_len + 1] for o in offsets.tolist()])
        return torch.from_numpy(rows.astype(np.int64))

    def eval_batch(self, index: int, *, sequences: int) -> torch.Tensor:
        """Validation batch ``index``: the validation windows in order (the same every time)."""
        if self.val_examples is not None:
            return self.eval_rows(index, sequences=sequences).tokens
        if self.val is None:
            raise ValueError(f"{self.name} has no validation windows")
        return self.val.in_order(index, sequences)


def replica_slice(rows: Rows, *, micro_batches: Sequence[int], micro_batch_size: int,
                  replica: int) -> MicroBatches:
    """Replica ``replica``'s consecutive rows of the global batch, cut into its micro-batches;
    each micro-batch's loss is divided by the global batch's learned targets."""
    start = sum(micro_batches[:replica]) * micro_batch_size
    end = start + micro_batches[replica] * micro_batch_size
    tokens, targets = rows.tokens[start:end], rows.targets[start:end]
    segments = None if rows.segments is None else list(rows.segments[start:end].split(micro_batch_size))
    return MicroBatches(inputs=[c[:, :-1] for c in tokens.split(micro_batch_size)],
                        targets=list(targets.split(micro_batch_size)), loss_tokens=rows.loss_tokens,
                        segments=segments)
