"""Issue 26, the command line's side: flags a hostile user tried (each refused at parsing with one line
naming the flag), names with terminal escapes (printed escaped), and limit errors that are exactly
one line on stderr (no empty line left by a progress bar before them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.errors import MedleyInputError

runner = CliRunner()
HUGE = str(10**20)
TRAIN = ["train", "--local-ranks", "1", "--steps", "1"]


def exactly_one_error_line(args: list[str]) -> str:
    """Exit 2 and stderr exactly one ``error:`` line: nothing before it, not even an empty line."""
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), repr(result.stderr)
    assert "\x1b" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "flag", "bound"), [
    ([*TRAIN, "--seed", HUGE], "--seed", "4294967295"),  # was `rank 0 failed (ValueError: Overflow...)`
    ([*TRAIN, "--seed", "-1"], "--seed", "0"),
    ([*TRAIN, "--warmup-steps", HUGE], "--warmup-steps", "1000000000"),
    ([*TRAIN, "--steps", HUGE], "--steps", "1000000000"),
])
def test_train_flags_out_of_range(args: list[str], flag: str, bound: str) -> None:
    line = exactly_one_error_line(args)
    assert f"'{flag}'" in line and bound in line, line


def test_a_train_config_seed_out_of_range_names_the_flag() -> None:
    from medley.runtime.config import TrainConfig, check_config

    with pytest.raises(MedleyInputError, match=r"--seed 1099511627776: use a seed in 0\.\.4,294,967,295"):
        check_config(TrainConfig.of(seed=2**40))


SEQ_LEN_LINE = ("4096: longer than the longest sequence of model 'tiny', 128 (max_seq_len); use --seq-len "
                "128 or less")


@pytest.mark.parametrize("command", [
    ["plan", "--cluster", "2xA100-80GB", "--model", "tiny", "--global-batch", "4"],
    ["simulate", "--cluster", "2xA100-80GB", "--model", "tiny"],
    ["train", "--local-ranks", "1"],
])
def test_a_sequence_longer_than_the_model_is_refused_as_train_refuses_it(command: list[str]) -> None:
    """`plan` and `simulate` made plans of 4,096 tokens for tiny (at most 128) that `train` refused."""
    assert exactly_one_error_line([*command, "--seq-len", "4096"]) == f"error: --seq-len {SEQ_LEN_LINE}"


def test_show_refuses_a_plan_file_of_too_long_sequences(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    made = runner.invoke(app, ["plan", "--cluster", "2xA100-80GB", "--model", "tiny", "--global-batch", "4",
                               "--seq-len", "64", "--out", str(plan), "--no-baselines"])
    assert made.exit_code == 0, made.output
    plan.write_text(plan.read_text().replace("seq_len = 64", "seq_len = 4096"))
    line = exactly_one_error_line(["show", str(plan)])
    assert line == f"error: {plan}: table 'layout': seq_len {SEQ_LEN_LINE}"


def test_the_default_sequence_fits_the_model() -> None:
    """Without --seq-len, tiny (at most 128 tokens) is simulated at 128, not refused at 2,048."""
    result = runner.invoke(app, ["simulate", "--cluster", "2xA100-80GB", "--model", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    assert '"seq_len": 128' in result.stdout


def test_a_limit_error_is_exactly_one_line() -> None:
    """`medley plan --global-batch 20000` printed an empty line (its progress bar's) before the error."""
    line = exactly_one_error_line(["plan", "--cluster", "2xA100-80GB", "--model", "tiny", "--global-batch",
                                   "20000", "--seq-len", "64"])
    assert line.startswith("error: --global-batch 20000: give 1..10,000 sequences per step")


ESC_CLUSTER = ('name = "\\u001b[31mevil\\u001b]0;title\\u0007"\n[[nodes]]\nname = "one"\ndevice = "CPU-8GB"\n'
               'count = 2\n[[tiers]]\nname = "t\\u001b[2Jx"\nbandwidth_gbps = 10\n')


def test_terminal_escapes_in_names_are_printed_escaped(tmp_path: Path) -> None:
    """A cluster and a tier named with ESC sequences (colour, window title, clear screen) were printed
    raw by `medley cluster show`; simulate's tables and lines name them too."""
    path = tmp_path / "esc.toml"
    path.write_text(ESC_CLUSTER)
    shown = runner.invoke(app, ["cluster", "show", str(path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert "Cluster '\\x1b[31mevil\\x1b]0;title\\x07'" in shown.stdout and "t\\x1b[2Jx" in shown.stdout


def test_terminal_escapes_in_an_error_are_printed_escaped(tmp_path: Path) -> None:
    line = exactly_one_error_line(["cluster", "show", str(tmp_path / "\x1b[2Jgone.toml")])
    assert "\\x1b[2Jgone.toml" in line
