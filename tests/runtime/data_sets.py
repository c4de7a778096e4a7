"""Small data sets shared by the data tests (importable by the launched ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

_BASES = ["Bread is flour, water, salt and time.", "A starter is flour and water, alive.",
          "Knead the dough until it is smooth.", "Bake it hot, then let it cool."]
DOCS = [f"{text} Loaf {i} of {i * 7 % 13} rose." for i, text in enumerate(_BASES * 6)]


def expected_stream(tokenizer_path: Path, docs: list[str]) -> np.ndarray:
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc, add_special_tokens=False).ids + [eos]
    return np.asarray(ids)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_save_to_disk(directory: Path, docs: list[str]) -> Path:
    directory.mkdir()
    table = pa.table({"text": docs})
    with pa.ipc.new_stream(directory / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text("{}")
    return directory
