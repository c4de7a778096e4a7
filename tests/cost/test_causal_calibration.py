"""Causal flash attention is costed over the tiles it computes, and the catalog's calibration
(matmul, attention and memory efficiency, kernel overhead per type) is data the estimator reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from medley.cost.estimator import ATTENTION_MATMULS, CatalogCostSource, causal_share, matmul_time
from medley.cost.interfaces import Pass
from medley.spec.catalog import (
    DEFAULT_KERNEL_OVERHEAD_US,
    DEFAULT_MATMUL_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    get_device_type,
    load_catalog,
)
from medley.spec.model_arg import get_model


def test_causal_share_counts_the_tiles_on_and_below_the_diagonal() -> None:
    assert causal_share(100) == 1.0  # one tile: computed whole
    assert causal_share(256) == 0.75  # 3 of 4 tiles
    assert causal_share(4096) == pytest.approx(33 / 64)
    assert 0.5 < causal_share(131072) < 0.501


def test_a_causal_attention_matmul_costs_its_share_of_the_square() -> None:
    h100 = get_device_type("H100")
    args = {"dtype": "bf16", "batch": 64, "ceiling": h100.attention_efficiency}
    full = matmul_time(h100, 8192, 8192, 128, **args)
    causal = matmul_time(h100, 8192, 8192, 128, work=causal_share(8192), **args)
    assert causal == pytest.approx(full * causal_share(8192))


def test_flash_attention_backward_runs_five_matmuls_to_the_forward_two() -> None:
    # A block's F holds two causal attention matmuls and its B five, beside its linear and
    # elementwise work (B: the linear matmuls once, as F; the elementwise at most twice F's).
    assert ATTENTION_MATMULS == {Pass.F: 2, Pass.B: 5, Pass.W: 0}
    model = get_model("llama-2-7b")
    h100 = get_device_type("H100")
    seq = 32768
    one = matmul_time(h100, seq, seq, model.head_dim, dtype="bf16", batch=model.num_heads,
                      ceiling=h100.attention_efficiency, work=causal_share(seq))
    source = CatalogCostSource(model)
    at = {"micro_batch_size": 1, "seq_len": seq, "device_type": "H100"}
    f = source.layer_time(1, Pass.F, **at).seconds - 2 * one
    b = source.layer_time(1, Pass.B, **at).seconds - 5 * one
    w = source.layer_time(1, Pass.W, **at).seconds  # the linear matmuls alone
    assert 0 < w <= f and w <= b <= 2 * f


def test_calibrated_types_carry_their_source_and_others_keep_the_defaults() -> None:
    catalog = load_catalog()
    calibrated = [t for t in catalog.values() if t.calibration]
    assert {t.name for t in calibrated} >= {"A100-80GB", "A100-40GB", "H100-SXM-80GB"}
    for device in calibrated:
        assert "bench/published" in device.calibration
        assert 0 < device.attention_efficiency <= 1 and 0 < device.matmul_efficiency <= 1
        assert 0 < device.memory_efficiency <= 1 and device.kernel_overhead_us >= 0
    t4 = catalog["T4-16GB"]
    assert (t4.matmul_efficiency, t4.attention_efficiency, t4.memory_efficiency, t4.kernel_overhead_us) == (
        DEFAULT_MATMUL_EFFICIENCY, DEFAULT_MATMUL_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY,
        DEFAULT_KERNEL_OVERHEAD_US)


def test_a_catalog_file_overrides_the_calibration_and_the_estimate_follows(tmp_path: Path) -> None:
    extra = tmp_path / "mine.toml"
    extra.write_text('[devices."A100-80GB"]\nmatmul_efficiency = 0.35\nkernel_overhead_us = 50.0\n')
    mine = load_catalog(extra)
    assert mine["A100-80GB"].matmul_efficiency == 0.35 and mine["A100-80GB"].kernel_overhead_us == 50.0
    model = get_model("llama-2-7b")
    at = {"micro_batch_size": 4, "seq_len": 2048, "device_type": "A100-80GB"}
    builtin = CatalogCostSource(model).layer_time(1, Pass.W, **at).seconds  # W: matmuls only
    halved = CatalogCostSource(model, catalog=mine).layer_time(1, Pass.W, **at).seconds
    assert halved == pytest.approx(builtin * load_catalog()["A100-80GB"].matmul_efficiency / 0.35, rel=0.02)
    tiny = get_model("tiny")
    small = {"micro_batch_size": 1, "seq_len": 16, "device_type": "A100-80GB"}
    assert CatalogCostSource(tiny, catalog=mine).layer_time(1, Pass.W, **small).seconds >= 50e-6 * 2
