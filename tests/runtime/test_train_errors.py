"""How `medley train` ends (issue #11, defects 3, 4, 7 and 10, train part): bad input is exit 2
and one line before any work; a diverged run, a killed rank, SIGINT and a killed launcher each
end with one line (or none), no traceback and no rank left behind.

The launches run `.venv/bin/medley` as a subprocess (fork + exec, never a fork of pytest) in its
own session, so that signals reach it as they would from a terminal.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cli.train_cmd import inline_plan, print_records, split_label, step_time_line
from medley.plan.inline import InlineFlags
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.train import StepRecord

MEDLEY = str(Path(sys.executable).with_name("medley"))
TWO_RANKS = ["train", "--local-ranks", "2", "--pp", "2", "--split", "2,2", "--micro-batches", "2",
             "--seq-len", "32", "--json"]


def one_line_error(result) -> str:  # noqa: ANN001
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize(("flag", "value"), [
    ("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--min-lr", "inf"), ("--weight-decay", "nan"),
    ("--clip-norm", "inf"), ("--step-timeout", "nan"),
])
def test_non_finite_numbers_are_refused(flag: str, value: str) -> None:
    line = one_line_error(CliRunner().invoke(app, ["train", flag, value]))
    assert f"{flag} {float(value)}: must be a finite number" in line


def test_negative_gc_every_is_refused() -> None:
    line = one_line_error(CliRunner().invoke(app, ["train", "--gc-every", "-1"]))
    assert line == "error: --gc-every -1 must be >= 0 (0: automatic collection)"


def test_output_paths_are_checked_before_any_work(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = one_line_error(CliRunner().invoke(app, ["train", "--checkpoint-dir", str(a_file)]))
    assert line.startswith(f"error: --checkpoint-dir {a_file}: is a file, not a directory")
    line = one_line_error(CliRunner().invoke(app, ["train", "--log-jsonl", str(tmp_path)]))
    assert line.startswith(f"error: --log-jsonl {tmp_path}: is a directory")


@pytest.mark.parametrize(("text", "problem"), [("", "is empty"), ("short text", "has 10 bytes, too few")])
def test_data_files_too_short_are_refused_before_launch(tmp_path: Path, text: str, problem: str) -> None:
    data = tmp_path / "data.txt"
    data.write_text(text)
    line = one_line_error(CliRunner().invoke(app, ["train", "--data", str(data), "--local-ranks", "1"]))
    assert f"--data {data}: {problem} for sequences of 128 tokens" in line


def test_the_split_is_echoed_as_given_and_labelled() -> None:
    blocks = inline_plan(InlineFlags(pp=2, micro_batches="4", micro_batch_size=2, seq_len=64, split="2,2"),
                         cluster=None, model="tiny", clip_grad=True)
    assert split_label(blocks, "2,2") == "split 2,2 (blocks per stage)"
    assert split_label(blocks, "3,3") == "split 3,3 (layers per stage)"
    assert split_label(blocks, None) == "split 3,3 (layers per stage)"
    out = io.StringIO()
    print_records(blocks, [_record(0, 0.5)], Console(file=out, width=200), split="2,2")
    assert "split 2,2 (blocks per stage)" in out.getvalue() and "[3, 3]" not in out.getvalue()


def _record(step: int, seconds: float) -> StepRecord:
    return StepRecord(step=step, loss=5.0, lr=1e-3, grad_norm=1.0, step_time_s=seconds, tokens_per_s=1.0,
                      mfu=None)


def test_the_step_time_line_says_which_steps_it_covers() -> None:
    assert step_time_line([_record(0, 0.5)]) == "step time 500.0 ms (a single step, warm-up included)"
    assert step_time_line([_record(0, 0.5), _record(1, 0.1), _record(2, 0.2)]) == (
        "mean step 150.0 ms over 2 steps (the first step excluded)")


# --- launches --------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Launch:
    """`medley train` in its own session, its output in files (ranks inherit them)."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.log = tmp_path / "steps.jsonl"
        self.stderr_path = tmp_path / "stderr.txt"
        with open(tmp_path / "stdout.txt", "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([MEDLEY, *args, "--log-jsonl", str(self.log)], stdout=out,
                                         stderr=err, start_new_session=True,
                                         env={**os.environ, "MEDLEY_DEBUG": "0"})

    def wait_for_steps(self, timeout_s: float = 180) -> list[int]:
        """Pids of the launcher's descendants once the ranks have logged a step."""
        deadline = time.monotonic() + timeout_s
        while not (self.log.exists() and self.log.read_text().strip()):
            assert self.proc.poll() is None, self.stderr_path.read_text()
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.2)
        return descendants(self.proc.pid)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> None:
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[type[Launch]]:
    started: list[Launch] = []

    def start(args: list[str]) -> Launch:
        started.append(Launch(tmp_path, args))
        return started[-1]

    yield start  # type: ignore[misc]
    for one in started:
        one.stop()


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.timeout(300)
def test_killing_the_launcher_stops_its_ranks(launch, tmp_path: Path) -> None:  # noqa: ANN001
    run = launch([*TWO_RANKS, "--steps", "100000", "--checkpoint-dir", str(tmp_path / "ckpt")])
    ranks = run.wait_for_steps()
    assert len(ranks) >= 2
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    assert gone_within(ranks, 5), [p for p in ranks if running(p)]


@pytest.mark.timeout(300)
def test_sigint_stops_every_rank_with_one_line_and_exit_130(launch, tmp_path: Path) -> None:  # noqa: ANN001
    run = launch([*TWO_RANKS, "--steps", "100000"])
    ranks = run.wait_for_steps()
    os.killpg(run.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
    assert run.proc.wait(timeout=60) == 130
    assert gone_within(ranks, 5)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == ["interrupted (SIGINT): the ranks were stopped; run again to resume from the newest "
                     "checkpoint"], run.stderr


@pytest.mark.timeout(300)
def test_a_killed_rank_is_one_line(launch, tmp_path: Path) -> None:  # noqa: ANN001
    run = launch([*TWO_RANKS, "--steps", "100000"])
    pids = run.wait_for_steps()
    forkserver = next(p for p in pids if descendants(p))
    victim = sorted(descendants(forkserver))[-1]
    os.kill(victim, signal.SIGKILL)
    assert run.proc.wait(timeout=120) == 1
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in lines[0]
    assert gone_within(pids, 5)


@pytest.mark.timeout(300)
def test_a_diverged_run_exits_2_and_keeps_its_good_checkpoint(launch, tmp_path: Path) -> None:  # noqa: ANN001
    """The issue's run: --lr 100 on tiny with checkpoints (the loss turned NaN at step 7 and the
    run exited 0 with every kept checkpoint NaN)."""
    directory = tmp_path / "ckpt"
    run = launch(["train", "--local-ranks", "1", "--lr", "100", "--steps", "20", "--checkpoint-dir",
                  str(directory), "--checkpoint-every", "2", "--json"])
    assert run.proc.wait(timeout=240) == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "training diverged" in lines[0], run.stderr
    diverged = int(lines[0].split("step ")[1].split(":")[0])
    kept = sorted(directory.glob("step-*"))
    assert kept and all(int(path.name[5:]) <= diverged for path in kept)
    for path in kept:  # every tensor of every kept checkpoint is finite (they were all NaN)
        assert all(bool(torch.isfinite(t).all()) for t in load_all(path).values() if t.is_floating_point())


def load_all(path: Path) -> dict[str, torch.Tensor]:
    metadata = SafeReader(path).read_metadata()
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()}
    dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return state


@pytest.mark.parametrize("debug", ["0", "1"])
def test_a_step_timeout_is_one_line_and_stacks_only_with_debug(debug: str) -> None:
    script = ("import time; from medley.runtime.lifecycle import StepWatchdog; "
              "StepWatchdog(0.5, rank=1).arm(7); time.sleep(30)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**env, "MEDLEY_DEBUG": debug})
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert first.startswith("error: rank 1: step 7 ran longer than --step-timeout 0.5 s (a rank stopped"), (
        done.stderr)
    if debug == "0":
        assert done.stderr.splitlines() == [first]
    else:
        assert "most recent call first" in done.stderr  # every thread's stack
