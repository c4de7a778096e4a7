"""Each setting is defined once, on its dataclass field (medley.flags.setting), and the options,
job-file keys and docs are made from it (issue 42, findings 1 and 2).

The inline plan's flags (medley.plan.inline.InlineFlags): ``simulate`` and ``train`` take the same
options with the same defaults (on 415c156 they differed in micro-batches, micro-batch size,
sequence length and buckets, and train had no --recompute), and the job file's [plan] section
holds each of them. The run's settings (medley.runtime.settings.TrainConfig): every field that is
a flag is one option of ``train`` with the field's default and one job-file key, and the config
``train`` builds from its flags is the one the fields describe."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer
from typer.main import get_command
from typer.testing import CliRunner

from medley.cli.job_file import PLAN_DEFINING, SECTIONS
from medley.cli.main import app
from medley.cli.options import settings_options
from medley.cli.train_cmd import inline_plan
from medley.flags import flag_name, flag_of
from medley.plan.inline import InlineFlags
from medley.runtime.settings import FLAGS, TrainConfig

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
            assert flag_of(field).help in param.help
        one, other = simulate[field.name], train[field.name]
        assert (one.type_descriptor.annotation, one.is_flag, one.min) == (
            other.type_descriptor.annotation, other.is_flag, flag_of(field).minimum)


def test_the_job_file_plan_section_holds_every_inline_flag() -> None:
    # The LoRA flags have a section of their own, [adapter]; every inline flag defines the plan.
    lora = {name for name in NAMES if name.startswith("lora_")}
    assert lora == set(SECTIONS["adapter"]) == {"lora_rank", "lora_alpha", "lora_dropout", "lora_targets"}
    assert set(NAMES) - lora <= set(SECTIONS["plan"]) and set(NAMES) <= set(PLAN_DEFINING)


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


def _setting_fields() -> list[tuple[str, dataclasses.Field]]:
    return [(section.name, f) for section in dataclasses.fields(TrainConfig)
            for f in dataclasses.fields(section.default_factory()) if flag_of(f) is not None]


def test_every_setting_is_one_train_option_and_one_job_key() -> None:
    train = _params("train")
    placed = [name for names in SECTIONS.values() for name in names]
    assert len(placed) == len(set(placed))  # one key each
    for section, field in _setting_fields():
        name = flag_name(field)
        param = train[name]
        assert param.opts == ["--" + name.replace("_", "-")] and name in placed
        assert FLAGS[name] == (section, field.name)
        flag = flag_of(field)
        if flag.parse is None:
            assert param.default == field.default, name
        assert (param.min, param.max) == (flag.minimum, flag.maximum), name
    no_flag = {f.name for section in dataclasses.fields(TrainConfig)
               for f in dataclasses.fields(section.default_factory()) if flag_of(f) is None}
    assert no_flag == {"hf_dir", "loss_scale_init", "loss_scale_backoff", "loss_scale_growth",  # set apart
                       "loss_scale_growth_interval", "progress", "measure_memory", "trace_actions",
                       "admit_wait_s"}


def test_the_config_train_builds_is_the_fields_own() -> None:
    """The defaults give TrainConfig(); an ``off`` flag's 0 is the field's None; a ``parse`` flag
    is parsed; a renamed flag reaches its field."""
    built: list[TrainConfig] = []
    probe = typer.Typer()

    @probe.command()
    @settings_options()
    def run(*, config: TrainConfig) -> None:
        built.append(config)

    assert CliRunner().invoke(probe, []).exit_code == 0
    assert built[-1] == TrainConfig()
    result = CliRunner().invoke(probe, ["--clip-norm", "0", "--step-timeout", "0", "--slowdown", "0=2,3=1.5",
                                        "--checkpoint-dir", "ckpt", "--optimizer", "sgd", "--keep", "5"])
    assert result.exit_code == 0, result.output
    config = built[-1]
    assert config.optimizer.clip_norm is None and config.logging.step_timeout_s is None
    assert config.emulation.slowdown == {0: 2.0, 3: 1.5}
    assert (config.checkpoint.dir, config.optimizer.name, config.checkpoint.keep) == (Path("ckpt"), "sgd", 5)
