"""What a run shows as it goes when stderr is a file (nohup, SLURM): one line per logged step
with the loss, lr, throughput (learned tokens where the loss skips some), memory and time left;
a launched chat run through the CLI prints them to a pipe; the summary table after a long run
holds about 20 of its steps, counted as steps done."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from chat_sets import chatml_tokenizer, write_chats
from rich.console import Console

from medley.cli.train_cmd import TABLE_ROWS, inline_plan, print_records
from medley.plan.inline import InlineFlags
from medley.runtime.records import StepRecord
from medley.runtime.train_progress import TrainProgress, progress_line

MEDLEY = str(Path(sys.executable).with_name("medley"))


def _record(step: int, **extra: object) -> StepRecord:
    base = dict(step=step, loss=2.5, lr=3e-4, grad_norm=1.0, step_time_s=0.05, tokens_per_s=1000.0, mfu=None)
    return StepRecord(**{**base, **extra})


def test_a_line_per_logged_step_when_stderr_is_a_file() -> None:
    out = io.StringIO()  # not a terminal
    progress = TrainProgress(10, 0, stream=out)
    for step in (0, 4, 9):
        progress.logged(_record(step, learned_tokens_per_s=400.0, peak_memory_bytes={0: 2_000_000_000,
                                                                                   1: 3_500_000_000}))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("train step 1/10 · loss 2.5000 · lr 3.00e-04 · 1,000 tok/s (400 learned)")
    assert "3.5 GB" in lines[0] and "ETA" not in lines[0], "no rate before a second logged step"
    assert re.search(r"ETA \d+m\d\ds$", lines[1]) and lines[2].endswith("ETA 0m00s")


def test_text_runs_show_no_learned_share() -> None:
    line = progress_line(_record(0, learned_tokens_per_s=1000.0), 5)
    assert "learned" not in line and "GB" not in line


def test_a_long_runs_table_shows_about_twenty_steps_counted_as_done() -> None:
    plan = inline_plan(InlineFlags(micro_batches="2", micro_batch_size=2, seq_len=32), cluster="1xA100-80GB",
                       model="tiny", clip_grad=True, dtype="fp32")
    records = [_record(s, eval_loss=4.0 if s == 77 else None) for s in range(150)]
    out = io.StringIO()
    print_records(plan, records, Console(file=out, width=200))
    rows = [line for line in out.getvalue().splitlines() if re.match(r"^\W*\d+ ", line)]
    steps = [int(re.match(r"^\W*(\d+)", row).group(1)) for row in rows]
    assert steps[0] == 1 and steps[-1] == 150 and 78 in steps, "first, last and the evaluated step"
    assert len(steps) <= TABLE_ROWS + 2
    assert "one step in 8 of 150" in out.getvalue()


@pytest.mark.timeout(300)
def test_a_launched_run_logs_lines_to_a_pipe(tmp_path: Path) -> None:
    tokenizer = chatml_tokenizer(tmp_path / "chatml")
    data = write_chats(tmp_path / "chat.jsonl", 24)
    done = subprocess.run(
        [MEDLEY, "train", "--local-ranks", "2", "--pp", "2", "--split", "3,3", "--micro-batches", "2",
         "--seq-len", "64", "--steps", "4", "--log-every", "2", "--data", str(data), "--tokenizer",
         str(tokenizer), "--data-cache", str(tmp_path / "cache"), "--pack"],
        capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("train step")]
    assert [line.split(" · ")[0] for line in lines] == ["train step 1/4", "train step 2/4", "train step 4/4"]
    assert all("learned)" in line and "lr " in line for line in lines)
    assert "--pack: packed 24 examples into" in done.stdout + done.stderr
