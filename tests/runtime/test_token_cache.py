"""Issue 26, findings 8, 9, 11 and 12: the token cache is used only when whole (else rebuilt),
a full disk is one line naming the cache and its free space, no temporary file outlives a
build, and bad text data is one line naming the file and line."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_sets import DOCS, expected_stream, write_jsonl, write_save_to_disk

from medley.data import cache as cache_module
from medley.data.load import DataOptions, load_source
from medley.errors import MedleyInputError

SEQ = 8


def _options(tmp_path: Path, tokenizer: Path) -> DataOptions:
    return DataOptions(tokenizer=str(tokenizer), cache_dir=tmp_path / "cache")


def _cache(tmp_path: Path) -> tuple[Path, Path]:
    tokens = next((tmp_path / "cache").glob("*.tokens"))
    return tokens, tokens.with_suffix(".json")


@pytest.fixture
def built(tmp_path: Path, bpe_tokenizer: Path) -> tuple[Path, DataOptions, np.ndarray]:
    """A jsonl data set (DOCS, 4 times) and its built cache; the ids whole encoding gives."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS * 4)
    options = _options(tmp_path, bpe_tokenizer)
    load_source(data, seq_len=SEQ, options=options)
    return data, options, expected_stream(bpe_tokenizer, DOCS * 4)


def _reloads_whole(data: Path, options: DataOptions, want: np.ndarray, *, verify: bool = True) -> None:
    source = load_source(data, seq_len=SEQ, options=options, verify=verify)
    assert np.array_equal(np.asarray(source.train.tokens), want)
    assert source.fingerprint == hashlib.sha256(want.astype(np.uint16).tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("verify", [True, False])
def test_a_truncated_tokens_file_is_rebuilt(built, tmp_path: Path, verify: bool) -> None:
    """The probe trained on 500 of 129,618 tokens: the count in the .json was never checked."""
    data, options, want = built
    tokens, _ = _cache(tmp_path)
    tokens.write_bytes(tokens.read_bytes()[:1000])
    _reloads_whole(data, options, want, verify=verify)


@pytest.mark.parametrize("sidecar", [
    b"garbage", b"[]", b"{}", b'{"version": 2}', b"\xff\xfe", b"[" * 100_000,
    json.dumps({"version": 2, "dtype": "uint16", "tokens": "2", "text_tokens": 1, "documents": 1,
                "sha256": "0" * 64}).encode(),
    json.dumps({"version": 2, "dtype": "float32", "tokens": 2, "text_tokens": 1, "documents": 1,
                "sha256": "0" * 64}).encode(),
    json.dumps({"version": 2, "dtype": "uint16", "tokens": True, "text_tokens": 1, "documents": 1,
                "sha256": "0" * 64}).encode(),
], ids=["text", "list", "empty", "fields-missing", "not-utf8", "deep", "string-count", "dtype", "bool-count"])
def test_a_garbage_or_mistyped_sidecar_is_rebuilt(built, tmp_path: Path, sidecar: bytes) -> None:
    """Once exit 1 with JSONDecodeError, KeyError or TypeError, naming no file, never rebuilt."""
    data, options, want = built
    _cache(tmp_path)[1].write_bytes(sidecar)
    _reloads_whole(data, options, want)


def test_edited_ids_are_rebuilt_even_with_a_matching_count(built, tmp_path: Path) -> None:
    """Same size, other ids: the launching process hashes the ids. Out-of-range ids with a
    re-hashed .json (the probe's IndexError in rank 0) are refused by the range check."""
    data, options, want = built
    tokens, meta_path = _cache(tmp_path)
    ids = np.fromfile(tokens, dtype=np.uint16)
    ids[5] = ids[6]
    ids.tofile(tokens)
    _reloads_whole(data, options, want)
    ids[5] = 60_000  # far outside the 256-token vocabulary
    ids.tofile(tokens)
    meta = json.loads(meta_path.read_text())
    meta["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    _reloads_whole(data, options, want)


def test_a_full_disk_is_one_line_naming_the_cache(tmp_path: Path, bpe_tokenizer, monkeypatch) -> None:
    """Once a 107-line traceback: the OSError of a write to a full disk carries no file name."""
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    real = os.fdopen

    class Full:
        def __init__(self, handle) -> None:  # noqa: ANN001
            self.handle = handle

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd: int, mode: str = "r", *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        handle = real(fd, mode, *args, **kwargs)
        return Full(handle) if mode == "wb" else handle

    monkeypatch.setattr(cache_module.os, "fdopen", fdopen)
    with pytest.raises(MedleyInputError) as info:
        load_source(data, seq_len=SEQ, options=_options(tmp_path, bpe_tokenizer))
    message = str(info.value)
    assert "\n" not in message and ".tokens: cannot write (No space left on device, " in message
    assert "MiB free)" in message and str(tmp_path / "cache") in message
    assert list((tmp_path / "cache").iterdir()) == []  # no temporary file, no half cache


BUILD = """
import sys
from pathlib import Path
from medley.data.load import DataOptions, load_source
options = DataOptions(tokenizer=sys.argv[2], cache_dir=Path(sys.argv[3]))
load_source(Path(sys.argv[1]), seq_len=8, options=options)
"""


@pytest.mark.timeout(120)
def test_the_temporary_file_of_a_killed_build_is_removed(tmp_path: Path, bpe_tokenizer) -> None:
    """A build killed outright (the probe's 100 MB document, by the out-of-memory killer) cannot
    remove its temporary file: the next build removes those of dead processes on this host."""
    data = write_jsonl(tmp_path / "d.jsonl", [" ".join(DOCS) * 1000])  # 0.9 MB: about a second
    cache = tmp_path / "cache"
    build = subprocess.Popen([sys.executable, "-c", BUILD, str(data), str(bpe_tokenizer), str(cache)])
    deadline = time.monotonic() + 100
    while not list(cache.glob(".*.tmp")) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    build.kill()
    build.wait()
    left = list(cache.glob(".*.tmp"))
    assert len(left) == 1 and not list(cache.glob("*.json")), "the build ended before it was killed"
    short = write_jsonl(tmp_path / "short.jsonl", DOCS)  # another build in the same cache
    load_source(short, seq_len=SEQ, options=DataOptions(tokenizer=str(bpe_tokenizer), cache_dir=cache))
    assert not left[0].exists()
    assert not list(cache.glob(".*.tmp"))


def test_documents_without_text_are_refused(tmp_path: Path, bpe_tokenizer) -> None:
    """300 empty texts once trained on 300 end-of-document tokens."""
    data = write_jsonl(tmp_path / "empty.jsonl", [""] * 300)
    with pytest.raises(MedleyInputError, match=r"--data .*empty.jsonl: 300 documents with no text"):
        load_source(data, seq_len=SEQ, options=_options(tmp_path, bpe_tokenizer))


@pytest.mark.parametrize(("line", "words"), [
    (b'{"text": "caf\xe9"}', "d.jsonl:2: not UTF-8 (byte 13 of the line)"),
    (b"[" * 100_000 + b"]" * 100_000, "d.jsonl:2: JSON nested too deeply"),
    (b'{"text": "bread \\ud800 rose"}',
     "d.jsonl:2: field 'text' holds a lone surrogate ('\\ud800' at character 6)"),
], ids=["not-utf8", "deep", "lone-surrogate"])
def test_bad_jsonl_lines_are_one_line_naming_the_line(tmp_path: Path, bpe_tokenizer, line: bytes,
                                                       words: str) -> None:
    """Once UnicodeDecodeError, RecursionError and TypeError (exit 1, no file named)."""
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "bread"}\n' + line + b"\n")
    with pytest.raises(MedleyInputError) as info:
        load_source(data, seq_len=SEQ, options=_options(tmp_path, bpe_tokenizer))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_bad_id_in_a_bin_file_is_named_at_its_position(tmp_path: Path) -> None:
    """The range error once said "near position 0" for an id at position 19,999."""
    ids = np.full(30_000, 7, dtype=np.uint16)
    ids[19_999] = 300
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(MedleyInputError, match="token id 300 at position 19999 is outside"):
        load_source(tmp_path / "t.bin", seq_len=SEQ)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["d.jsonl", "t.txt", "t.bin", "p.parquet", "tokenizer.json", "/dev/zero",
                                  "saved/state.json", "saved/data-00000-of-00001.arrow"])
def test_a_fifo_or_device_as_data_or_tokenizer_is_refused_at_once(tmp_path: Path, bpe_tokenizer, name: str) \
        -> None:
    """Finding 13: a FIFO once blocked forever (a device read without end); each case runs under a
    timeout, so a regression fails instead of hanging."""
    tokenizer, data = str(bpe_tokenizer), tmp_path / name
    if name == "tokenizer.json":
        tokenizer, data = str(_fifo(tmp_path / name)), write_jsonl(tmp_path / "d.jsonl", DOCS)
    elif name.startswith("saved/"):
        write_save_to_disk(tmp_path / "saved", DOCS)
        _fifo(data)
        data = tmp_path / "saved"
    elif name.startswith("/"):
        data = Path(name)
    else:
        _fifo(data)
    options = DataOptions(tokenizer=None if name == "t.bin" else tokenizer, cache_dir=tmp_path / "cache")
    with pytest.raises(MedleyInputError) as info:
        load_source(data, seq_len=SEQ, options=options)
    kind = "a character device" if name.startswith("/") else "a FIFO (named pipe)"
    assert f": is {kind}, not a regular file" in str(info.value), info.value


def _fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path
