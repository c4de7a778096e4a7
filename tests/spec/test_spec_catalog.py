from pathlib import Path

import pytest

from medley.errors import MedleyInputError
from medley.spec.catalog import get_device_type, load_catalog


def test_catalog_covers_at_least_18_accelerators_with_sane_numbers():
    catalog = load_catalog()
    assert len(catalog) >= 18
    for device in catalog.values():
        assert device.peak_tflops_half > device.peak_tflops_fp32 > 0
        assert device.memory_gb > 0 and device.memory_bandwidth_gbps > 0
        assert device.intra_node_link in ("nvlink", "pcie")
        assert device.confidence in ("high", "medium", "low")
        assert device.memory_bytes == int(device.memory_gb * 1e9)


def test_names_and_aliases_match_case_insensitively():
    assert get_device_type("a100-80gb").name == "A100-80GB"
    assert get_device_type("A100-SXM4-80GB").name == "A100-80GB"
    assert get_device_type("h100").name == "H100-SXM-80GB"
    assert get_device_type(" t4 ").name == "T4-16GB"


def test_v100_and_t4_have_no_bf16_and_fp16_peaks():
    assert not get_device_type("V100-32GB").supports_bf16
    assert not get_device_type("T4-16GB").supports_bf16
    assert get_device_type("V100-32GB").peak_tflops_half == 125.0
    assert get_device_type("T4-16GB").peak_tflops_half == 65.0


def test_unknown_name_suggests_close_ones():
    with pytest.raises(MedleyInputError, match="A100-80GB"):
        get_device_type("A100-80G")


def test_user_file_overrides_some_fields_and_adds_types(tmp_path: Path):
    extra = tmp_path / "mine.toml"
    extra.write_text(
        '[devices."T4-16GB"]\npeak_tflops_half = 30.0\n'
        '[devices."X1-8GB"]\npeak_tflops_half = 10\npeak_tflops_fp32 = 1\nmemory_gb = 8\n'
        'memory_bandwidth_gbps = 100\nintra_node_link = "pcie"\nintra_node_bandwidth_gbps = 16\n'
        'supports_bf16 = true\nconfidence = "low"\n'
    )
    catalog = load_catalog(extra)
    assert catalog["T4-16GB"].peak_tflops_half == 30.0
    assert catalog["T4-16GB"].memory_gb == 16
    assert get_device_type("x1-8gb", catalog).memory_gb == 8
    assert load_catalog()["T4-16GB"].peak_tflops_half == 65.0  # the built-in stays untouched


def test_incomplete_new_entry_names_missing_fields(tmp_path: Path):
    extra = tmp_path / "mine.toml"
    extra.write_text('[devices."X1-8GB"]\npeak_tflops_half = 10\n')
    with pytest.raises(MedleyInputError, match="missing.*memory_gb"):
        load_catalog(extra)
