"""Issue 46, the job file and the flags beside a plan: every value is used as given or refused with
one line naming it (exit 2). Plan-making flags or keys beside ``--plan`` (or ``plan =``) are
refused, in ``medley train`` and ``medley launch`` alike; ``~`` and ``$NAME`` in a job file's
values expand as a shell would, and an unset variable is refused; TOML types are strict (no
boolean for a number, no float for an integer, no text for a number); one key per setting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from refusals import one_line_refusal, runner
from typer.main import get_command

from medley.cli.job_file import PLAN_DEFINING, SECTIONS, setting_type
from medley.cli.main import app

TRAIN = get_command(app).get_command(None, "train")  # type: ignore[attr-defined]
PARAMS = [p for p in TRAIN.params if p.name != "job"]


def key_of(param) -> str:  # noqa: ANN001 - a typer option
    return next(opt[2:].replace("-", "_") for opt in param.opts if opt.startswith("--"))


def section_of(name: str) -> str:
    return next(section for section, names in SECTIONS.items() if name in names)


def parsed(job: Path) -> dict:
    """``medley train --config job``'s parameters as the command would receive them (nothing runs)."""
    return TRAIN.make_context("train", ["--config", str(job)]).params


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "base.toml"
    made = runner.invoke(app, ["plan", "--cluster", "1xA100-80GB+1xV100-32GB", "--model", "tiny",
                               "--global-batch", "8", "--seq-len", "64", "--out", str(out)])
    assert made.exit_code == 0, made.output
    return out


# Finding 1: on 415c156 both trained the plan file's pp 2 at seq 64 and exited 0.
def test_plan_flags_beside_a_plan_are_refused_naming_them(base_plan: Path) -> None:
    line = one_line_refusal(["train", "--plan", str(base_plan), "--local-ranks", "2", "--steps", "2",
                             "--seq-len", "32", "--pp", "4", "--micro-batches", "3"])
    assert re.search(r"--pp, --micro-batches, --seq-len: they set an inline plan, and the plan file "
                     r"\S*base\.toml fixes the plan; remove them", line), line


def test_plan_keys_beside_a_job_files_plan_are_refused_naming_the_key(base_plan: Path,
                                                                      tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f'[plan]\nplan = "{base_plan}"\nseq_len = 32\n[model]\nmodel = "tiny"\n')
    line = one_line_refusal(["train", "--config", str(job), "--local-ranks", "2", "--steps", "2"])
    assert f"{job} [model] model, {job} [plan] seq_len: they set an inline plan" in line, line


def test_launch_refuses_plan_flags_after_the_dashes_and_keeps_run_settings(base_plan: Path,
                                                                          tmp_path: Path) -> None:
    launch = ["launch", str(base_plan), "--rdzv-endpoint", "h:1", "--dry-run", "--"]
    line = one_line_refusal([*launch, "--steps", "3", "--split", "1,3"])
    assert line.startswith("error: the training flags after --: --split: it sets an inline plan"), line
    job = tmp_path / "job.toml"
    job.write_text("[plan]\npp = 2\n")
    assert "[plan] pp: it sets an inline plan" in one_line_refusal([*launch, "--config", str(job)])
    # The settings a plan leaves to the run stay allowed beside it.
    ok = runner.invoke(app, [*launch, "--steps", "3", "--lr", "1e-3", "--data", "synthetic",
                             "--dtype", "fp32", "--checkpoint-every", "2", "--emulate"])
    assert ok.exit_code == 0, ok.output


def test_the_plan_defining_settings_are_the_inline_plan_flags() -> None:
    """Every plan-defining setting is a flag whose help says it is the inline plan's (and the model)."""
    helps = {p.name: str(p.help) for p in PARAMS}
    assert set(PLAN_DEFINING) == {name for name, text in helps.items() if text.startswith("Inline plan")}


# Finding 2: on 415c156 "~/ckpt" became a folder named "~" beside the job file.
def test_home_and_variables_in_job_file_paths_expand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, shared = tmp_path / "home", tmp_path / "shared"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MEDLEY_TEST_SHARED", str(shared))
    job = tmp_path / "jobs" / "job.toml"
    job.parent.mkdir()
    job.write_text('[checkpoint]\ncheckpoint_dir = "~/ckpt"\n'
                   '[logging]\nlog_jsonl = "${MEDLEY_TEST_SHARED}/log.jsonl"\ntensorboard = "tb"\n')
    params = parsed(job)
    assert params["checkpoint_dir"] == home / "ckpt"
    assert params["log_jsonl"] == shared / "log.jsonl"
    assert params["tensorboard"] == job.parent.resolve() / "tb"  # relative: the job file's directory


def test_home_in_path_flags_expands_where_the_shell_leaves_it(tmp_path: Path, base_plan: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``--checkpoint-dir=~/ckpt``: bash expands no ``~`` after ``=``; train and launch do."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    params = TRAIN.make_context("train", ["--checkpoint-dir=~/ckpt", "--data", "~/d.jsonl"]).params
    assert params["checkpoint_dir"] == tmp_path / "home" / "ckpt"
    assert params["data"] == str(tmp_path / "home" / "d.jsonl")
    result = runner.invoke(app, ["launch", str(base_plan), "--rdzv-endpoint", "h:1", "--dry-run", "--json",
                                 "--", "--checkpoint-dir=~/ckpt"])
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)["nodes"][0]["command"]
    assert f"--checkpoint-dir={tmp_path / 'home' / 'ckpt'}" in command
    line = one_line_refusal(["train", "--checkpoint-dir", "~medley-no-such-user/c"])
    assert "~medley-no-such-user names no user's home here" in line, line


@pytest.mark.parametrize(("value", "message"), [
    ("$MEDLEY_TEST_UNSET/ckpt", "$MEDLEY_TEST_UNSET is not set here; set it or write the path out"),
    ("${MEDLEY_TEST_UNSET}/ckpt", "$MEDLEY_TEST_UNSET is not set here"),
    ("~medley-no-such-user/ckpt", "~medley-no-such-user names no user's home here"),
])
def test_what_cannot_expand_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
                                       message: str) -> None:
    monkeypatch.delenv("MEDLEY_TEST_UNSET", raising=False)
    job = tmp_path / "job.toml"
    job.write_text(f'[checkpoint]\ncheckpoint_dir = "{value}"\n')
    line = one_line_refusal(["train", "--config", str(job)])
    assert f'[checkpoint] checkpoint_dir = "{value}": {message}' in line, line
    assert not any(tmp_path.iterdir()) or sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


# Finding 4: on 415c156 `steps = true` trained one step and exited 0.
@pytest.mark.parametrize(("section", "body", "message"), [
    ("optimizer", "steps = true", "steps = true: a boolean; write steps = 20"),
    ("plan", "local_ranks = true", "local_ranks = true: a boolean; write local_ranks = 2 (an integer)"),
    ("checkpoint", "keep = true", "keep = true: a boolean"),
    ("checkpoint", "checkpoint_every = true",
     "checkpoint_every = true: a boolean; write checkpoint_every = 0"),
    ("checkpoint", "keep = 2.0", "keep = 2.0: not an integer"),
    ("optimizer", "lr = true", "lr = true: a boolean; write lr = 0.003"),
    ("logging", "json = 1", "json = 1: not a boolean; write json = true or json = false"),
])
def test_booleans_and_floats_are_not_numbers(tmp_path: Path, section: str, body: str, message: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f"[{section}]\n{body}\n")
    assert f"[{section}] {message}" in one_line_refusal(["train", "--config", str(job)])


# Finding 5: on 415c156 both were taken and the later won.
def test_two_spellings_of_one_key_are_refused(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[checkpoint]\ncheckpoint-every = 2\ncheckpoint_every = 5\n")
    line = one_line_refusal(["train", "--config", str(job)])
    assert "[checkpoint] checkpoint-every and checkpoint_every are one setting; keep one of them" in line


WRONG: dict[type, list[str]] = {  # TOML values of another type than the setting's
    int: ["true", "false", "2.5", "2.0", '"2"', "[1, 2]", "{ a = 1 }"],
    float: ["true", '"0.5"', "[0.5]", "{ a = 1 }"],
    bool: ["1", "0", "1.0", '"true"', "[true]"],
    str: ["true", "2.5", "[1, 2]", '["a"]', "{ a = 1 }"],
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path: Path, data: st.DataObject) -> None:
    param = data.draw(st.sampled_from(PARAMS))
    value = data.draw(st.sampled_from(WRONG[setting_type(param)]))
    key, section = key_of(param), section_of(param.name)
    job = tmp_path / "job.toml"
    job.write_text(f"[{section}]\n{key} = {value}\n")
    line = one_line_refusal(["train", "--config", str(job)])
    assert f"{job}: [{section}] {key} = " in line and "; write " in line, line
