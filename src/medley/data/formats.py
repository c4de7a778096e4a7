"""Reading the documents of a text data set, one at a time, without holding the file whole.

Formats (:func:`data_format` tells them apart): ``.jsonl`` (one JSON object per line, the text in
a field), ``.parquet`` files or a directory of them (the text in a column), a ``datasets``
``save_to_disk`` directory (``state.json`` and its ``data-*.arrow`` IPC stream files, read with
pyarrow), plain text (``.txt``, ``.md``, ``.text`` or no suffix). Token files (``.bin``) are
read by :mod:`medley.data.tokens`.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from medley.errors import MedleyInputError
from medley.fileio import check_regular_file, open_user_file, read_user_json

TEXT_SUFFIXES = ("", ".txt", ".text", ".md")
FORMATS_HELP = ("a .jsonl or .parquet file, a directory of .parquet files or a datasets save_to_disk "
                "directory, a .bin token file, a text file (.txt), or 'synthetic'")
_TEXT_CHUNK = 1 << 16  # bytes of plain text read at a time
_ROWS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads lets a lone \\ud800 through; tokenizers refuse it


def data_format(path: Path, *, flag: str) -> str:
    """``jsonl``, ``parquet``, ``arrow`` (save_to_disk), ``tokens`` (.bin) or ``text``."""
    if path.is_dir():
        if (path / "state.json").exists():
            return "arrow"
        if any(path.glob("*.parquet")):
            return "parquet"
        raise MedleyInputError(f"{flag} {path}: a directory without .parquet files or a datasets "
                               f"state.json; give {FORMATS_HELP}")
    if not path.exists():
        raise MedleyInputError(f"{flag} {path}: no such file; check the path")
    check_regular_file(path, what="data file")
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
    elif fmt in ("parquet", "arrow"):
        for file in _table_files(path, fmt, flag=flag):
            schema, batches = _open(file, fmt, flag=flag)
            _column(schema, file, field=field, flag=flag)
            yield from _rows(batches([field]), file, field=field, flag=flag)
    else:
        yield from _text(path, flag=flag)


def records(path: Path, fmt: str, *, fields: tuple[str, ...], flag: str) -> Iterator[tuple[str, dict]]:
    """The rows of a jsonl, parquet or save_to_disk data set as (where, row): ``where`` names the
    file and line or row for messages; a parquet or arrow row holds those of ``fields`` it has."""
    if fmt == "jsonl":
        with open_user_file(path, what="data file", flag=flag) as handle:
            for number, raw in enumerate(handle, start=1):
                where = f"{flag} {path}:{number}"
                row = _jsonl_row(raw, where=where)
                if row is None:
                    continue
                if not isinstance(row, dict):
                    raise MedleyInputError(f"{where}: not a JSON object; give one object per line")
                yield where, row
        return
    if fmt not in ("parquet", "arrow"):
        raise MedleyInputError(f"{flag} {path}: instruction data is read from .jsonl, .parquet or a datasets "
                               "save_to_disk directory; convert it to one of those")
    for file in _table_files(path, fmt, flag=flag):
        schema, batches = _open(file, fmt, flag=flag)
        names = [n for n in fields if n in schema.names]
        number = 1  # rows counted from 1, as jsonl lines are
        try:
            for batch in batches(names):
                for row in batch.to_pylist():
                    yield f"{flag} {file} row {number}", row
                    number += 1
        except (OSError, pa.ArrowException) as err:
            raise MedleyInputError(f"{flag} {file}: cannot read its rows ({type(err).__name__}: {err}); "
                                   "check the file") from None


def _table_files(path: Path, fmt: str, *, flag: str) -> list[Path]:
    """The files of a parquet data set (one file or a directory's) or of a save_to_disk directory."""
    return input_files(path, fmt) if fmt == "parquet" else _arrow_files(path, flag=flag)


Batches = Callable[[list[str]], Iterator[pa.RecordBatch]]


def _open(file: Path, fmt: str, *, flag: str) -> tuple[pa.Schema, Batches]:
    """A parquet file or a save_to_disk arrow stream, opened: its schema, and its record batches
    of the columns named (read as they are iterated)."""
    check_regular_file(file, what="data file")
    try:
        if fmt == "parquet":
            reader = pq.ParquetFile(file)
            return reader.schema_arrow, lambda names: reader.iter_batches(batch_size=_ROWS, columns=names)
        stream = pa.ipc.open_stream(pa.memory_map(str(file)))
        return stream.schema, lambda names: (batch.select(names) for batch in stream)
    except (OSError, pa.ArrowException) as err:
        what = "a readable parquet file" if fmt == "parquet" else "an arrow stream file"
        raise MedleyInputError(f"{flag} {file}: not {what} ({err}); check the file") from None


def _jsonl(path: Path, *, field: str, flag: str) -> Iterator[str]:
    """The ``field`` text of each line's object. A line is read whole (its JSON needs it), but
    decoded and parsed on its own, so a bad line is named by its number."""
    with open_user_file(path, what="data file", flag=flag) as handle:
        for number, raw in enumerate(handle, start=1):
            text = _jsonl_text(raw, path=path, number=number, field=field, flag=flag)
            del raw
            if text is not None:
                yield text


def _jsonl_row(raw: bytes, *, where: str) -> object:
    """Line ``raw``'s JSON value, None for a blank line, or a one-line error naming the line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MedleyInputError(f"{where}: not UTF-8 (byte {err.start} of the line); give UTF-8 JSON lines") \
            from None
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise MedleyInputError(f"{where}: not JSON ({err.msg}); give one JSON object per line") from None
    except RecursionError:
        raise MedleyInputError(f"{where}: JSON nested too deeply; give one flat JSON object per line") \
            from None


def _jsonl_text(raw: bytes, *, path: Path, number: int, field: str, flag: str) -> str | None:
    """Line ``number``'s text, None for a blank line, or a one-line error naming the line."""
    where = f"{flag} {path}:{number}"
    row = _jsonl_row(raw, where=where)
    if row is None:
        return None
    text = row.get(field) if isinstance(row, dict) else None
    if isinstance(row, dict) and field in row and text is None:
        raise null_text(where, field)
    if not isinstance(text, str):
        what = "has no" if not isinstance(row, dict) or field not in row else "has a non-text"
        raise MedleyInputError(f"{where}: {what} field '{field}'; name the text field with --text-field")
    surrogate = _SURROGATE.search(text)
    if surrogate is not None:
        raise MedleyInputError(f"{where}: field '{field}' holds a lone surrogate "
                               f"({ascii(surrogate.group())} at character {surrogate.start()}), which is not "
                               "text; fix the \\u escape there")
    return text


def null_text(where: str, field: str) -> MedleyInputError:
    """The refusal of a row whose text field is null (a JSON ``null``, a parquet or arrow null),
    alike in every format: the row was once dropped from parquet and arrow data without a word."""
    return MedleyInputError(f"{where}: field '{field}' is null, not text; give the row a text or remove it")


def _column(schema: pa.Schema, file: Path, *, field: str, flag: str) -> None:
    if field not in schema.names:
        raise MedleyInputError(f"{flag} {file}: no column '{field}' (columns: {', '.join(schema.names)}); "
                               "name the text column with --text-field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise MedleyInputError(f"{flag} {file}: column '{field}' holds {schema.field(field).type}, not text; "
                               "name the text column with --text-field")


def _rows(batches: Iterator[pa.RecordBatch], file: Path, *, field: str, flag: str) -> Iterator[str]:
    """The texts of ``batches``; a null text is refused naming its row (counted from 1 in the
    file, as jsonl lines are), as a jsonl ``null`` is; damage found while reading them is one line."""
    number = 1
    try:
        for batch in batches:
            column = batch.column(field)
            texts = column.to_pylist()
            if column.null_count:
                raise null_text(f"{flag} {file} row {number + texts.index(None)}", field)
            yield from texts
            number += len(texts)
    except (OSError, pa.ArrowException, UnicodeDecodeError) as err:
        raise MedleyInputError(f"{flag} {file}: cannot read its rows ({type(err).__name__}: {err}); check "
                               "the file") from None


def _arrow_files(directory: Path, *, flag: str) -> list[Path]:
    fix = "give the directory save_to_disk wrote"
    state = read_user_json(directory / "state.json", what="datasets state", fix=fix)
    try:
        return [directory / Path(entry["filename"]).name for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise MedleyInputError(f"{flag} {directory}/state.json: not a datasets save_to_disk state (no "
                               f"_data_files list); {fix}") from None


def _text(path: Path, *, flag: str) -> Iterator[str]:
    """A plain text file as one document, in pieces of about ``_TEXT_CHUNK`` bytes (split
    anywhere: :mod:`.streaming` chooses where to cut it for the tokenizer)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    read = 0
    with open_user_file(path, what="data file", flag=flag) as handle:
        while True:
            block = handle.read(_TEXT_CHUNK)
            try:
                piece = decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise MedleyInputError(f"{flag} {path}: not UTF-8 text (byte {read + err.start}); give a "
                                       "UTF-8 text file") from None
            if piece:
                yield piece
            if not block:
                return
            read += len(block)
