"""The inline plan's flags are defined once (medley.plan.inline.InlineFlags): ``simulate`` and
``train`` take the same options with the same defaults (on 415c156 they differed in micro-batches,
micro-batch size, sequence length and buckets, and train had no --recompute), and the job file's
[plan] section holds each of them."""

from __future__ import annotations

import dataclasses
import json

from typer.main import get_command
from typer.testing import CliRunner

from medley.cli.job_file import PLAN_DEFINING, SECTIONS
from medley.cli.main import app
from medley.cli.train_cmd import inline_plan
from medley.plan.inline import InlineFlags

NAMES = [f.name for f in dataclasses.fields(InlineFlags)]


def _params(command: str) -> dict:
    return {p.name: p for p in get_command(app).get_command(None, command).params}


def test_simulate_and_train_take_every_inline_flag_with_one_default() -> None:
    simulate, train = _params("simulate"), _params("train")
    for field in dataclasses.fields(InlineFlags):
        for params in (simulate, train):
            param = params[field.name]
            assert param.default == field.default, field.name
            assert param.opts[0] == "--" + field.name.replace("_", "-")
            assert field.metadata["help"] in param.help
        one, other = simulate[field.name], train[field.name]
        assert (one.type_descriptor.annotation, one.is_flag, one.min) == (
            other.type_descriptor.annotation, other.is_flag, field.metadata["min"])


def test_the_job_file_plan_section_holds_every_inline_flag() -> None:
    assert set(NAMES) <= set(SECTIONS["plan"]) and set(NAMES) <= set(PLAN_DEFINING)


def test_train_takes_the_recompute_mode_simulate_takes() -> None:
    flags = InlineFlags(pp=2, micro_batches="2", recompute_mode="selective,full:1")
    plan = inline_plan(flags, cluster="2xA100-80GB", model="tiny", clip_grad=False, dtype="fp32")
    assert [str(r) for r in plan.layout.recompute] == ["selective", "full:1"]
    out = CliRunner().invoke(app, ["simulate", "--cluster", "2xA100-80GB", "--model", "tiny", "--pp", "2",
                                   "--micro-batches", "2", "--recompute-mode", "selective,full:1", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["recompute_mode"] == ["selective", "full:1"]


def test_the_defaults_make_the_same_layout_in_both_commands() -> None:
    plan = inline_plan(InlineFlags(), cluster="1xA100-80GB", model="tiny", clip_grad=False, dtype="bf16")
    out = CliRunner().invoke(app, ["simulate", "--cluster", "1xA100-80GB", "--model", "tiny", "--json"])
    data = json.loads(out.output)
    layout = plan.layout
    assert (data["micro_batches"], data["micro_batch_size"], data["seq_len"]) == (
        list(layout.micro_batches), layout.micro_batch_size, layout.seq_len)
    assert layout.seq_len == 128 and layout.micro_batches == (8,)  # tiny's longest sequence; 8 x 1
