"""A row whose text is null is refused alike in jsonl, parquet and save_to_disk data (issue 46,
finding 8): one line naming the file, the row (jsonl line; parquet and arrow rows counted from 1)
and the field, exit 2 from ``medley train``. Parquet and arrow nulls were dropped without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_sets import DOCS, write_save_to_disk
from typer.testing import CliRunner

from medley.cli.main import app
from medley.data.load import DataOptions, load_source
from medley.errors import MedleyInputError

SEQ = 8
NULL_AT = 7  # the 8th row: the second batch of the save_to_disk file (5 rows a batch)
WHY = "field 'text' is null, not text; give the row a text or remove it"


def with_null() -> list[str | None]:
    return [None if i == NULL_AT else doc for i, doc in enumerate(DOCS)]


def data_sets(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each format with the same null row, and how its refusal names that row."""
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(with_null())))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": with_null()}), parquet, row_group_size=5)
    saved = write_save_to_disk(tmp_path / "saved", with_null())  # type: ignore[arg-type]
    return {"parquet": (parquet, f"{parquet} row {NULL_AT + 1}"),
            "save_to_disk": (saved, f"{saved / 'data-00000-of-00001.arrow'} row {NULL_AT + 1}"),
            "jsonl": (jsonl, f"{jsonl}:{NULL_AT + 1}")}


def test_every_format_refuses_a_null_text_naming_the_row(tmp_path: Path, bpe_tokenizer: Path) -> None:
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache")
    for name, (path, where) in data_sets(tmp_path).items():
        with pytest.raises(MedleyInputError) as refused:
            load_source(path, seq_len=SEQ, options=options)
        assert str(refused.value) == f"--data {where}: {WHY}", name


def test_medley_train_exits_2_with_the_same_line(tmp_path: Path, bpe_tokenizer: Path) -> None:
    for name, (path, where) in data_sets(tmp_path).items():
        result = CliRunner().invoke(app, ["train", "--local-ranks", "1", "--data", str(path), "--tokenizer",
                                          str(bpe_tokenizer), "--data-cache", str(tmp_path / "cache")])
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and "Traceback" not in result.output, (name, result.output)
        assert lines == [f"error: --data {where}: {WHY}"], name


def test_a_parquet_without_nulls_still_loads(tmp_path: Path, bpe_tokenizer: Path) -> None:
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "ok.parquet", row_group_size=5)
    source = load_source(tmp_path / "ok.parquet", seq_len=SEQ,
                         options=DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache"))
    assert source.train is not None and source.train.count > 0
