"""Reading the documents of a text data set, one at a time, without holding the file whole.

Formats (:func:`data_format` tells them apart): ``.jsonl`` (one JSON object per line, the text in
a field), ``.parquet`` files or a directory of them (the text in a column), a ``datasets``
``save_to_disk`` directory (``state.json`` and its ``data-*.arrow`` IPC stream files, read with
pyarrow), plain text (``.txt``, ``.md``, ``.text`` or no suffix). Token files (``.bin``) are
read by :mod:`medley.runtime.data.tokens`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from medley.errors import MedleyInputError

TEXT_SUFFIXES = ("", ".txt", ".text", ".md")
FORMATS_HELP = ("a .jsonl or .parquet file, a directory of .parquet files or a datasets save_to_disk "
                "directory, a .bin token file, a text file (.txt), or 'synthetic'")
_TEXT_CHUNK = 1 << 20  # plain text is tokenized in pieces of about this many characters
_ROWS = 1024


def data_format(path: Path, *, flag: str) -> str:
    """``jsonl``, ``parquet``, ``arrow`` (save_to_disk), ``tokens`` (.bin) or ``text``."""
    if path.is_dir():
        if (path / "state.json").is_file():
            return "arrow"
        if any(path.glob("*.parquet")):
            return "parquet"
        raise MedleyInputError(f"{flag} {path}: a directory without .parquet files or a datasets "
                               f"state.json; give {FORMATS_HELP}")
    if not path.is_file():
        raise MedleyInputError(f"{flag} {path}: no such file; check the path")
    suffix = path.suffix.lower()
    known = {".jsonl": "jsonl", ".parquet": "parquet", ".bin": "tokens"}
    if suffix in known:
        return known[suffix]
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise MedleyInputError(f"{flag} {path}: unknown extension '{path.suffix}'; give {FORMATS_HELP}")


def input_files(path: Path, fmt: str) -> list[Path]:
    """The files a data set reads, in reading order."""
    if fmt == "parquet" and path.is_dir():
        return sorted(path.glob("*.parquet"))
    if fmt == "arrow":
        return [path / "state.json", *_arrow_files(path, flag="--data")]
    return [path]


def documents(path: Path, fmt: str, *, field: str, flag: str) -> Iterator[str]:
    """The texts of the data set, in order (plain text in pieces of whole lines)."""
    if fmt == "jsonl":
        yield from _jsonl(path, field=field, flag=flag)
    elif fmt == "parquet":
        for file in input_files(path, fmt):
            yield from _parquet(file, field=field, flag=flag)
    elif fmt == "arrow":
        for file in _arrow_files(path, flag=flag):
            yield from _arrow(file, field=field, flag=flag)
    else:
        yield from _text(path, flag=flag)


def _jsonl(path: Path, *, field: str, flag: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise MedleyInputError(f"{flag} {path}:{number}: not JSON ({err.msg}); give one JSON "
                                       "object per line") from None
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                what = "has no" if not isinstance(row, dict) or field not in row else "has a non-text"
                raise MedleyInputError(f"{flag} {path}:{number}: {what} field '{field}'; name the text "
                                       "field with --text-field")
            yield text


def _column(schema: pa.Schema, file: Path, *, field: str, flag: str) -> None:
    if field not in schema.names:
        raise MedleyInputError(f"{flag} {file}: no column '{field}' (columns: {', '.join(schema.names)}); "
                               "name the text column with --text-field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise MedleyInputError(f"{flag} {file}: column '{field}' holds {schema.field(field).type}, not text; "
                               "name the text column with --text-field")


def _parquet(file: Path, *, field: str, flag: str) -> Iterator[str]:
    try:
        reader = pq.ParquetFile(file)
    except (OSError, pa.ArrowException) as err:
        raise MedleyInputError(f"{flag} {file}: not a readable parquet file ({err}); check the file") \
            from None
    _column(reader.schema_arrow, file, field=field, flag=flag)
    for batch in reader.iter_batches(batch_size=_ROWS, columns=[field]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def _arrow_files(directory: Path, *, flag: str) -> list[Path]:
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
        return [directory / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise MedleyInputError(f"{flag} {directory}/state.json: not a datasets save_to_disk state (no "
                               "_data_files list); give the directory save_to_disk wrote") from None


def _arrow(file: Path, *, field: str, flag: str) -> Iterator[str]:
    try:
        source = pa.memory_map(str(file))
        reader = pa.ipc.open_stream(source)
    except (OSError, pa.ArrowException) as err:
        raise MedleyInputError(f"{flag} {file}: not an arrow stream file ({err}); check the directory") \
            from None
    _column(reader.schema, file, field=field, flag=flag)
    for batch in reader:
        yield from (text for text in batch.column(field).to_pylist() if text is not None)


def _text(path: Path, *, flag: str) -> Iterator[str]:
    """A plain text file as one document, in pieces of whole lines (tokenized piece by piece)."""
    piece: list[str] = []
    size = 0
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                piece.append(line)
                size += len(line)
                if size >= _TEXT_CHUNK:
                    yield "".join(piece)
                    piece, size = [], 0
    except UnicodeDecodeError:
        raise MedleyInputError(f"{flag} {path}: not UTF-8 text; give a UTF-8 text file") from None
    if piece:
        yield "".join(piece)
