"""ProfileCostSource: exact and interpolated lookups, fallbacks and refusals, source names, and
what the compiler and ``medley simulate --profile`` take from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import Pass
from medley.cost.profile_format import Profile, save_profile
from medley.cost.profiles import ProfileCostSource
from medley.errors import MedleyInputError
from medley.lowering.compile import compile_problem
from medley.plan.layout import PlanLayout
from medley.schedule.zero_settings import StageZero
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

TINY = get_model("tiny")
CPU = "CPU-8GB"


def source(profile: Profile, fallback=None, **kwargs) -> ProfileCostSource:
    return ProfileCostSource(profile=profile, name="p.json", model=TINY, fallback=fallback, **kwargs)


def test_exact_shape_gives_the_measurement(profile: Profile) -> None:
    cost = source(profile)
    got = cost.layer_time(1, Pass.B, micro_batch_size=4, seq_len=128, device_type=CPU)
    assert got.seconds == pytest.approx(2 * 4 * 128e-6) and got.source == "profile:p.json"
    head = cost.layer_time(TINY.num_layers - 1, Pass.F, micro_batch_size=1, seq_len=64, device_type=CPU)
    assert head.seconds == pytest.approx(0.5 * 64e-6)
    assert cost.activation_bytes(2, micro_batch_size=1, seq_len=64, device_type=CPU) == (64000.0, 25600.0)


def test_between_measured_shapes_is_interpolated(profile: Profile) -> None:
    cost = source(profile)
    # Linear in the micro-batch size (1 -> 4) and in the sequence length (64 -> 128).
    got = cost.layer_time(1, Pass.F, micro_batch_size=2, seq_len=96, device_type=CPU)
    assert got.seconds == pytest.approx(2 * 96e-6) and got.source == "profile:p.json~interpolated"
    fused = cost.backward_full_time(1, micro_batch_size=3, seq_len=128, device_type=CPU)
    assert fused is not None and fused.seconds == pytest.approx(2.5 * 3 * 128e-6)


def test_outside_the_profile_falls_back_or_refuses(profile: Profile) -> None:
    catalog = CatalogCostSource(TINY, dtype="fp32")
    cost = source(profile, fallback=catalog)
    outside = cost.layer_time(1, Pass.F, micro_batch_size=8, seq_len=128, device_type=CPU)
    assert outside.source == "catalog"
    gpu = cost.layer_time(1, Pass.F, micro_batch_size=1, seq_len=64, device_type="A100-80GB")
    assert gpu.source == "catalog"
    assert cost.activation_bytes(1, micro_batch_size=8, seq_len=128, device_type=CPU) is None
    strict = source(profile)
    with pytest.raises(MedleyInputError, match=r"no block layer at micro-batch size 8.*--micro-batch-sizes"):
        strict.layer_time(1, Pass.F, micro_batch_size=8, seq_len=128, device_type=CPU)
    with pytest.raises(MedleyInputError, match=r"device type 'CPU-8GB', not 'T4-16GB'"):
        strict.layer_time(1, Pass.F, micro_batch_size=1, seq_len=64, device_type="T4-16GB")
    wider = dataclasses.replace(TINY, hidden_size=128)
    other = ProfileCostSource(profile=profile, name="p.json", model=wider)
    with pytest.raises(MedleyInputError, match=r"measured model 'tiny'.*medley profile --model"):
        other.layer_time(1, Pass.F, micro_batch_size=1, seq_len=64, device_type=CPU)


def test_device_scale_stretches_times_for_emulated_types(profile: Profile) -> None:
    cost = source(profile, device_scale={"CPU-x1": 1.0, "CPU-x3": 3.0})
    fast = cost.layer_time(1, Pass.W, micro_batch_size=1, seq_len=64, device_type="CPU-x1").seconds
    slow = cost.layer_time(1, Pass.W, micro_batch_size=1, seq_len=64, device_type="CPU-x3").seconds
    assert slow == pytest.approx(3 * fast)
    opt = cost.optimizer_time(1e6, device_type="CPU-x3")
    assert opt is not None and opt.seconds == pytest.approx(3 * (1e-5 + 1e-2))


def test_compile_uses_measured_activations_and_fused_backward(profile: Profile) -> None:
    cluster = parse_cluster_arg("2xCPU")
    layout = PlanLayout(model=TINY, pp=2, dp=1, assignment=((0, 1),), stage_layers=(3, 3), schedule="1f1b",
                        micro_batches=(4,), micro_batch_size=1, seq_len=64,
                        zero=(StageZero(level=0), StageZero(level=0)), dtype="fp32")
    problem = compile_problem(layout, cluster, source(profile))
    first, second = problem.stage_costs[0]
    t = 64e-6
    assert first.forward_s == pytest.approx(0.1 * t + t + t)  # embedding, two blocks
    # 1F1B runs the fused backward: B + W scaled to the measured fused time (2.5 t per block).
    assert first.backward_input_s + first.backward_weight_s == pytest.approx(2.5 * (0.1 * t + 2 * t))
    assert first.activation_bytes == pytest.approx(3 * 64000.0)
    boundary = 64 * TINY.hidden_size * 4  # the received input, held on top of what the layers add
    assert second.activation_bytes == pytest.approx(3 * 64000.0 + boundary)


def test_simulate_cli_names_the_source_of_every_layer_kind(tmp_path: Path, profile: Profile) -> None:
    path = tmp_path / "cpu.json"
    save_profile(profile, path)
    args = ["simulate", "--cluster", "2xCPU", "--model", "tiny", "--pp", "2", "--micro-batches", "4",
            "--seq-len", "64", "--profile", str(path), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["dtype"] == "fp32"
    assert data["cost_sources"] == {CPU: {"embedding": "profile:cpu.json", "block": "profile:cpu.json",
                                          "head": "profile:cpu.json"}}
    outside = CliRunner().invoke(app, [*args[:-1], "--micro-batch-size", "8", "--json"])
    assert json.loads(outside.output)["cost_sources"][CPU]["block"] == "catalog"
    missing = CliRunner().invoke(app, [*args[:-2], str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "cannot read the profile file" in missing.output
