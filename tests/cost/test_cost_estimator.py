import pytest

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource, matmul_efficiency, stage_time
from medley.cost.interfaces import CostSource, Pass, TimeEstimate
from medley.errors import MedleyInputError
from medley.spec.catalog import get_device_type
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


def model_time(source: CatalogCostSource, device: str, mbs: int, seq: int) -> float:
    return sum(
        source.layer_time(i, p, micro_batch_size=mbs, seq_len=seq, device_type=device).seconds
        for i in range(source.model.num_layers)
        for p in Pass
    )


def test_is_a_cost_source_and_tags_catalog():
    source: CostSource = CatalogCostSource(get_model("tiny"))
    estimate = source.layer_time(1, Pass.F, micro_batch_size=2, seq_len=64, device_type="T4")
    assert isinstance(estimate, TimeEstimate) and estimate.source == "catalog" and estimate.seconds > 0


def test_large_models_run_near_but_below_peak_and_faster_devices_are_faster():
    model = get_model("llama-2-7b")
    source = CatalogCostSource(model)
    flops = sum(
        formulas.layer_flops(model, i, p, micro_batch_size=2, seq_len=4096)
        for i in range(model.num_layers)
        for p in Pass
    )
    times = {d: model_time(source, d, 2, 4096) for d in ("H100", "A100-80GB", "V100-32GB", "T4")}
    for device, seconds in times.items():
        mfu = flops / seconds / get_device_type(device).peak_flops("bf16")
        assert 0.4 < mfu < 0.75, (device, mfu)
    assert times["H100"] < times["A100-80GB"] < times["V100-32GB"] < times["T4"]


def test_efficiency_grows_with_matrix_size():
    assert (
        matmul_efficiency(64, 64, 64)
        < matmul_efficiency(1024, 1024, 1024)
        < matmul_efficiency(8192, 8192, 8192)
    )
    assert matmul_efficiency(8192, 8192, 8192) <= 0.75


def test_small_layers_are_overhead_bound_not_flops_bound():
    source = CatalogCostSource(get_model("tiny"))
    a100 = model_time(source, "A100-80GB", 1, 128)
    h100 = model_time(source, "H100", 1, 128)
    assert a100 == pytest.approx(h100, rel=0.1)  # launch-bound: a faster chip barely helps


def test_time_grows_with_micro_batch_and_fp32_is_slower():
    model = get_model("llama-2-7b")
    bf16, fp32 = CatalogCostSource(model), CatalogCostSource(model, dtype="fp32")
    kw = {"seq_len": 2048, "device_type": "A100-80GB"}
    one = bf16.layer_time(3, Pass.F, micro_batch_size=1, **kw).seconds
    four = bf16.layer_time(3, Pass.F, micro_batch_size=4, **kw).seconds
    assert 3.0 < four / one < 4.5
    assert fp32.layer_time(3, Pass.F, micro_batch_size=1, **kw).seconds > 5 * one


def test_cluster_overrides_are_known_to_the_source():
    cluster = parse_cluster_arg("2xA100-80GB")
    model = get_model("llama-2-7b")
    source = CatalogCostSource.for_cluster(model, cluster)
    assert (
        stage_time(source, range(1, 5), Pass.F, micro_batch_size=1, seq_len=1024, device_type="A100-80GB") > 0
    )


def test_unknown_dtype_and_device_are_input_errors():
    with pytest.raises(MedleyInputError, match="dtype"):
        CatalogCostSource(get_model("tiny"), dtype="fp8")
    with pytest.raises(MedleyInputError, match="unknown device type"):
        CatalogCostSource(get_model("tiny")).layer_time(
            1, Pass.F, micro_batch_size=1, seq_len=8, device_type="Z9"
        )
