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


def test_cuda_names_find_their_catalog_entry() -> None:
    from medley.spec.catalog import device_type_for_cuda

    assert device_type_for_cuda("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert device_type_for_cuda("NVIDIA A100 80GB PCIe").name == "A100-PCIE-80GB"
    assert device_type_for_cuda("Tesla T4").name == "T4-16GB"
    assert device_type_for_cuda("tesla v100-sxm2-32gb").name == "V100-32GB"
    assert device_type_for_cuda("NVIDIA H200").name == "H200-SXM-141GB"


def test_an_unknown_gpu_names_close_entries_and_the_fix() -> None:
    import pytest

    from medley.errors import MedleyInputError
    from medley.spec.catalog import device_type_for_cuda

    with pytest.raises(MedleyInputError, match=r"closest entries: .*A100.*--device-type"):
        device_type_for_cuda("NVIDIA A100-SXM4-64GB")


def test_cuda_mismatch_checks_name_and_memory() -> None:
    from medley.spec.catalog import cuda_mismatch, get_device_type

    a100 = get_device_type("A100-80GB")
    assert cuda_mismatch(a100, "NVIDIA A100-SXM4-80GB", 85_100_000_000) is None
    assert "is not a A100-80GB" in cuda_mismatch(a100, "Tesla T4", 85_100_000_000)
    assert "42.0 GB of memory" in cuda_mismatch(a100, "NVIDIA A100-SXM4-80GB", 42_000_000_000)
    assert cuda_mismatch(get_device_type("T4"), "Tesla T4", 15_800_000_000) is None
