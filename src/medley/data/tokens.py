"""Token files: a ``.bin`` file of token ids as nanoGPT and Megatron-LM write them, memory-mapped.

The dtype: a Megatron-LM ``.idx`` file beside the ``.bin`` (same stem) names it in its header;
else ``--token-dtype`` (``uint16`` or ``uint32``); else ``uint16``, nanoGPT's convention (its
``prepare.py`` writes uint16). A wrong choice shows: a size that is not a multiple of the item
size, or ids at or above the model's vocabulary (uint32 data read as uint16 gives pairs of ids
whose high halves are 0, uint16 data read as uint32 gives huge ids); both are refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from medley.errors import MedleyInputError
from medley.fileio import check_regular_file, open_user_file

TOKEN_DTYPES = ("uint16", "uint32")
DEFAULT_TOKEN_DTYPE = "uint16"
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron-LM's indexed_dataset DType codes.
_MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
                    8: "uint16"}
_SCAN = 1 << 22  # ids read at a time when checking them (8 MiB of uint16)
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 16


def token_dtype(path: Path, chosen: str | None) -> str:
    """The dtype of ``path``'s ids: from a Megatron ``.idx`` beside it, ``chosen``, or uint16."""
    index = path.with_suffix(".idx")
    if index.exists():
        with open_user_file(index, what="Megatron index file") as handle:
            head = handle.read(len(_MEGATRON_MAGIC) + 9)
        if head.startswith(_MEGATRON_MAGIC) and len(head) == len(_MEGATRON_MAGIC) + 9:
            found = _MEGATRON_DTYPES.get(head[-1], f"code {head[-1]}")
            if found not in ("uint16", "int32", "int64", "uint8"):
                raise MedleyInputError(f"--data {index}: token dtype {found}; medley reads integer ids")
            if chosen is not None and np.dtype(chosen) != np.dtype(found):
                raise MedleyInputError(f"--token-dtype {chosen}: {index} says the ids are {found}; drop "
                                       "--token-dtype or fix it")
            return found
    if chosen is not None and chosen not in TOKEN_DTYPES:
        raise MedleyInputError(f"--token-dtype '{chosen}' must be uint16 or uint32")
    return chosen or DEFAULT_TOKEN_DTYPE


def open_token_file(path: Path, *, dtype: str, flag: str) -> np.memmap:
    """``path`` memory-mapped read-only as ids of ``dtype`` (its size must be a multiple)."""
    check_regular_file(path, what="token file")
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise MedleyInputError(f"{flag} {path}: the file is empty; give a token file")
    if size % item:
        raise MedleyInputError(f"{flag} {path}: {size} bytes is not a whole number of {dtype} ids; "
                               "wrong --token-dtype (uint16 or uint32)?")
    return np.memmap(path, dtype=dtype, mode="r")


def check_ids(path: Path, tokens: np.ndarray, *, vocab_size: int, flag: str, dtype: str) -> None:
    """Refuse ids outside ``[0, vocab_size)``, reading the file in pieces (never all at once);
    the error names the first bad id's position."""
    with open_user_file(path, what="token file", flag=flag) as handle:
        for start in range(0, len(tokens), _SCAN):
            piece = np.fromfile(handle, dtype=tokens.dtype, count=_SCAN)
            if piece.size and (int(piece.max()) >= vocab_size or int(piece.min()) < 0):
                at = int(np.flatnonzero((piece >= vocab_size) | (piece < 0))[0])
                raise MedleyInputError(
                    f"{flag} {path}: token id {int(piece[at])} at position {start + at} is outside the "
                    f"model's vocabulary of {vocab_size} as {dtype}; wrong --token-dtype, or a model with a "
                    "larger vocab_size")


def file_fingerprint(path: Path) -> str:
    """Hash of a token file's size and of 64 evenly spaced 64 KiB samples of it (a 1 GB file is
    not read whole on every start; an edit between samples that keeps the size goes unseen)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open_user_file(path, what="token file") as handle:
        for index in range(_SAMPLES):
            handle.seek(max(0, size - _SAMPLE_BYTES) * index // (_SAMPLES - 1))
            digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def check_not_wider(path: Path, tokens: np.ndarray, *, flag: str) -> None:
    """uint32 ids read as uint16 (the default) show as every other id being 0: refuse that."""
    head = np.asarray(tokens[:4096])
    if len(head) >= 8 and not head[1::2].any() and head[0::2].any():
        raise MedleyInputError(f"{flag} {path}: every other uint16 id is 0 (uint32 ids read as uint16); "
                               "pass --token-dtype uint32")
