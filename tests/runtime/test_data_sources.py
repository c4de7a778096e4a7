"""Data sets to token windows (no launch): jsonl, parquet, save_to_disk, .bin token files, the
token cache, the sample order, and bad inputs as one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from data_sets import DOCS, expected_stream, write_jsonl, write_save_to_disk

from medley.data.load import DataOptions, load_source
from medley.errors import MedleyInputError

SEQ = 8


def all_windows(stream: np.ndarray) -> set[tuple[int, ...]]:
    return {tuple(stream[i * SEQ:i * SEQ + SEQ + 1].tolist()) for i in range((len(stream) - 1) // SEQ)}


def test_jsonl_parquet_and_save_to_disk_give_documents_joined_by_eos(tmp_path: Path, bpe_tokenizer) -> None:
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache")
    want = expected_stream(bpe_tokenizer, DOCS)
    pq.write_table(pa.table({"text": DOCS[:10]}), tmp_path / "a.parquet")
    (tmp_path / "dir").mkdir()
    pq.write_table(pa.table({"text": DOCS[:10]}), tmp_path / "dir" / "0.parquet")
    pq.write_table(pa.table({"text": DOCS[10:]}), tmp_path / "dir" / "1.parquet")
    inputs = {"jsonl": write_jsonl(tmp_path / "d.jsonl", DOCS), "parquet dir": tmp_path / "dir",
              "save_to_disk": write_save_to_disk(tmp_path / "saved", DOCS)}
    for name, data in inputs.items():
        source = load_source(data, seq_len=SEQ, options=options)
        assert isinstance(source.train.tokens, np.memmap), name  # mapped, never read whole
        assert np.array_equal(np.asarray(source.train.tokens), want), name
    single = load_source(tmp_path / "a.parquet", seq_len=SEQ, options=options)
    assert np.array_equal(np.asarray(single.train.tokens), expected_stream(bpe_tokenizer, DOCS[:10]))


def test_a_text_field_is_chosen_and_the_cache_is_reused(tmp_path: Path, bpe_tokenizer) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache", text_field="body")
    first = load_source(data, seq_len=SEQ, options=options)
    caches = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(caches) == 2 and not any(name.startswith(".") for name in caches)  # no temporary left
    again = load_source(data, seq_len=SEQ, options=options)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == caches
    assert first.fingerprint == again.fingerprint
    write_jsonl(data, DOCS[:-1], field="body")  # a changed input makes a new cache and fingerprint
    changed = load_source(data, seq_len=SEQ, options=options)
    assert changed.fingerprint != first.fingerprint and len(list((tmp_path / "cache").iterdir())) == 4


def test_samples_are_windows_in_a_seeded_permutation_per_epoch(tmp_path: Path) -> None:
    ids = np.arange(801, dtype=np.uint16)  # every window distinct
    ids.tofile(tmp_path / "t.bin")
    source = load_source(tmp_path / "t.bin", seq_len=SEQ, vocab_size=1000)
    windows, count = all_windows(ids), source.train.count
    assert count == len(windows) == 100
    batches = [source.global_batch(step=s, seed=5, sequences=4, seq_len=SEQ) for s in range(50)]
    seen = [tuple(row.tolist()) for batch in batches for row in batch]
    assert set(seen[:100]) == windows and set(seen[100:]) == windows  # each epoch: every window once
    assert seen[:100] != seen[100:]  # in another order
    assert not torch.equal(source.global_batch(step=2, seed=6, sequences=4, seq_len=SEQ), batches[2])


def test_a_reloaded_source_gives_the_same_batches(tmp_path: Path, bpe_tokenizer) -> None:
    """What a resumed run relies on: the batch of step k depends on nothing else."""
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache")
    source = load_source(write_jsonl(tmp_path / "d.jsonl", DOCS), seq_len=SEQ, options=options)
    batch = source.global_batch(step=7, seed=5, sequences=4, seq_len=SEQ)
    assert {tuple(r.tolist()) for r in batch} <= all_windows(np.asarray(source.train.tokens))
    fresh = load_source(tmp_path / "d.jsonl", seq_len=SEQ, options=options, verify=False)
    assert torch.equal(fresh.global_batch(step=7, seed=5, sequences=4, seq_len=SEQ), batch)


def test_val_fraction_holds_out_the_last_windows(tmp_path: Path) -> None:
    ids = np.arange(801, dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    options = DataOptions(val_fraction=0.25)
    source = load_source(tmp_path / "t.bin", seq_len=SEQ, vocab_size=1000, options=options)
    assert (source.train.count, source.val.first, source.val.count) == (75, 75, 25)
    val = source.eval_batch(0, sequences=3)
    assert val[:, 0].tolist() == [600, 608, 616] and torch.equal(source.eval_batch(0, sequences=3), val)
    assert source.eval_batch(1, sequences=20)[5, 0] == 600  # in order, wrapping around
    train = torch.cat([source.global_batch(step=s, seed=0, sequences=5, seq_len=SEQ) for s in range(30)])
    assert int(train[:, 0].max()) < 600 and int(train.max()) <= 600  # never a held-out window


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_token_files_are_mapped_windows(tmp_path: Path, dtype: str) -> None:
    ids = (np.arange(1000) * 7 % 251).astype(dtype)
    path = tmp_path / "train.bin"
    ids.tofile(path)
    source = load_source(path, seq_len=SEQ, options=DataOptions(token_dtype=dtype))
    assert isinstance(source.train.tokens, np.memmap) and np.array_equal(source.train.tokens, ids)
    rows = source.global_batch(step=0, seed=0, sequences=4, seq_len=SEQ)
    assert {tuple(r.tolist()) for r in rows} <= all_windows(ids)


def test_a_megatron_idx_names_the_dtype(tmp_path: Path) -> None:
    np.arange(200, dtype=np.int32).tofile(tmp_path / "corpus.bin")
    (tmp_path / "corpus.idx").write_bytes(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([4]))
    source = load_source(tmp_path / "corpus.bin", seq_len=SEQ)
    assert source.train.tokens.dtype == np.int32 and int(source.train.tokens[199]) == 199
    with pytest.raises(MedleyInputError, match="--token-dtype uint16: .*corpus.idx says the ids are int32"):
        load_source(tmp_path / "corpus.bin", seq_len=SEQ, options=DataOptions(token_dtype="uint16"))


def test_bad_token_files_are_one_line(tmp_path: Path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(MedleyInputError, match=r"--data .*odd.bin: 3 bytes is not a whole number of uint16"):
        load_source(odd, seq_len=SEQ)
    wide = tmp_path / "wide.bin"
    np.arange(1, 500, dtype=np.uint32).tofile(wide)  # uint32 read as the default uint16
    with pytest.raises(MedleyInputError, match="every other uint16 id is 0.*--token-dtype uint32"):
        load_source(wide, seq_len=SEQ)
    big = tmp_path / "big.bin"
    np.full(100, 300, dtype=np.uint16).tofile(big)
    with pytest.raises(MedleyInputError, match="token id 300 .*outside the model's vocabulary of 256"):
        load_source(big, seq_len=SEQ)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(MedleyInputError, match="empty.bin: the file is empty"):
        load_source(tmp_path / "empty.bin", seq_len=SEQ)


def test_bad_text_inputs_are_one_line(tmp_path: Path, bpe_tokenizer, large_tokenizer) -> None:
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache")
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    with pytest.raises(MedleyInputError, match=r"d.jsonl:1: has no field 'body'; .*--text-field"):
        load_source(data, seq_len=SEQ, options=DataOptions(tokenizer=str(bpe_tokenizer), text_field="body",
                                                           cache_dir=tmp_path / "cache"))
    with pytest.raises(MedleyInputError, match="--tokenizer .*400 tokens, more than the model's vocab_size"):
        load_source(data, seq_len=SEQ, options=DataOptions(tokenizer=str(large_tokenizer)))
    (tmp_path / "d.csv").write_text("text\nbread\n")
    with pytest.raises(MedleyInputError, match="d.csv: unknown extension '.csv'; give a .jsonl or .parquet"):
        load_source(tmp_path / "d.csv", seq_len=SEQ)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(MedleyInputError, match="empty.jsonl: no text in it"):
        load_source(tmp_path / "empty.jsonl", seq_len=SEQ, options=options)
    with pytest.raises(MedleyInputError, match="jsonl data needs a tokenizer; pass --tokenizer"):
        load_source(data, seq_len=SEQ)
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "p.parquet")
    with pytest.raises(MedleyInputError, match=r"no column 'text' \(columns: body\)"):
        load_source(tmp_path / "p.parquet", seq_len=SEQ, options=options)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # nothing half-written


def test_byte_text_holds_out_its_tail_for_validation() -> None:
    source = load_source(None, seq_len=SEQ, options=DataOptions(val_fraction=0.1))
    assert source.train is None and source.val is not None and source.val.count >= 1
    assert len(source.text) + len(source.val.tokens) == len(load_source(None, seq_len=SEQ).text)
    assert source.fingerprint != load_source(None, seq_len=SEQ).fingerprint
    assert source.eval_batch(0, sequences=2).shape == (2, SEQ + 1)


def test_a_text_file_with_a_tokenizer_is_one_document(tmp_path: Path, bpe_tokenizer) -> None:
    text = "\n".join(DOCS) + "\n"
    (tmp_path / "t.txt").write_text(text)
    options = DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=tmp_path / "cache")
    source = load_source(tmp_path / "t.txt", seq_len=SEQ, options=options)
    assert np.array_equal(np.asarray(source.train.tokens), expected_stream(bpe_tokenizer, [text]))


def test_the_fingerprint_of_a_token_file_follows_its_content(tmp_path: Path) -> None:
    ids = np.arange(50_000, dtype=np.uint16) % 250
    ids.tofile(tmp_path / "t.bin")
    first = load_source(tmp_path / "t.bin", seq_len=SEQ).fingerprint
    ids[0] = 7
    ids.tofile(tmp_path / "t.bin")
    assert load_source(tmp_path / "t.bin", seq_len=SEQ).fingerprint != first
    held = load_source(tmp_path / "t.bin", seq_len=SEQ, options=DataOptions(val_fraction=0.1)).fingerprint
    assert held != load_source(tmp_path / "t.bin", seq_len=SEQ).fingerprint
    wide = DataOptions(token_dtype="uint32")
    with pytest.raises(MedleyInputError, match="outside the model's vocabulary of 256 as uint32"):
        load_source(tmp_path / "t.bin", seq_len=SEQ, options=wide)  # uint16 ids read as uint32
    assert load_source(tmp_path / "t.bin", seq_len=SEQ, options=wide, verify=False).fingerprint != first
