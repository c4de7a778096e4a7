"""`medley train` with data sets: bad data is exit 2 and one line before any rank starts; a run
reports validation losses in --json and in the table."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_sets import DOCS, write_jsonl
from rich.console import Console
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cli.train_cmd import inline_plan, print_records
from medley.plan.inline import InlineFlags
from medley.runtime.train import StepRecord

MEDLEY = str(Path(sys.executable).with_name("medley"))


def one_line_error(result) -> str:  # noqa: ANN001
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def refused(*args: str) -> str:
    return one_line_error(CliRunner().invoke(app, ["train", "--local-ranks", "1", *args]))


def test_bad_data_is_one_line_before_launch(tmp_path: Path, bpe_tokenizer, large_tokenizer) -> None:
    cache = ["--data-cache", str(tmp_path / "cache")]
    body = write_jsonl(tmp_path / "body.jsonl", DOCS, field="body")
    line = refused("--data", str(body), "--tokenizer", str(bpe_tokenizer), *cache)
    assert line == f"error: --data {body}:1: has no field 'text'; name the text field with --text-field"
    docs = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    line = refused("--data", str(docs), "--tokenizer", str(large_tokenizer), *cache)
    assert line.startswith(f"error: --tokenizer {large_tokenizer}: 400 tokens, more than the model's "
                           "vocab_size 256")
    (tmp_path / "empty.jsonl").write_text("")
    line = refused("--data", str(tmp_path / "empty.jsonl"), "--tokenizer", str(bpe_tokenizer), *cache)
    assert line.startswith(f"error: --data {tmp_path / 'empty.jsonl'}: no text in it")
    (tmp_path / "d.csv").write_text("text\nbread\n")
    assert refused("--data", str(tmp_path / "d.csv")).startswith(
        f"error: --data {tmp_path / 'd.csv'}: unknown extension '.csv'; give a .jsonl")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    assert "3 bytes is not a whole number of uint16 ids" in refused("--data", str(tmp_path / "odd.bin"))
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert "must be uint16 or uint32" in refused("--data", str(tmp_path / "t.bin"), "--token-dtype", "int8")
    assert "nothing to evaluate on; give --val-data FILE or --val-fraction F" in refused("--eval-every", "2")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_tensorboard_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    line = refused("--tensorboard", str(tmp_path / "tb"))
    assert line == (f"error: --tensorboard {tmp_path / 'tb'}: the tensorboard package is not installed; "
                    "pip install medley[tensorboard]")


def test_the_table_shows_eval_losses_where_measured() -> None:
    plan = inline_plan(InlineFlags(micro_batches="2", micro_batch_size=2, seq_len=32), cluster="1xA100-80GB",
                       model="tiny", clip_grad=True, dtype="fp32")
    records = [StepRecord(step=s, loss=5.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, tokens_per_s=1.0,
                          mfu=None, eval_loss=4.25 if s == 1 else None) for s in range(2)]
    out = io.StringIO()
    print_records(plan, records, Console(file=out, width=200))
    assert "eval loss" in out.getvalue() and "4.2500" in out.getvalue()


@pytest.mark.timeout(300)
def test_a_cli_run_reports_eval_losses_in_json(tmp_path: Path, bpe_tokenizer) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS * 4)
    done = subprocess.run(
        [MEDLEY, "train", "--local-ranks", "2", "--pp", "2", "--split", "2,2", "--micro-batches", "2",
         "--seq-len", "16", "--steps", "2", "--data", str(data), "--tokenizer", str(bpe_tokenizer),
         "--data-cache", str(tmp_path / "cache"), "--val-fraction", "0.2", "--eval-every", "2", "--json"],
        capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["records"]
    assert rows[0]["eval_loss"] is None and rows[1]["eval_loss"] > 0
    assert set(rows[1]["step_time_by_device"]) == {"0", "1"}
