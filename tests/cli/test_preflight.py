"""The pre-flight checks: a plan that cannot fit this machine's memory, or a sequence longer than the
model's, is refused before any rank builds a model."""

from __future__ import annotations

import time

import pytest

from medley.cli.preflight import RANK_BASE_BYTES, check_cpu_memory, predicted_peaks, preflight
from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


def plan_for(model: str, *, pp: int = 1, dp: int = 1, seq_len: int = 64) -> Plan:
    cluster = parse_cluster_arg(f"{pp * dp}xA100-80GB")
    spec = get_model(model)
    layout = inline_layout(cluster=cluster, model=spec, cost=CatalogCostSource.for_cluster(spec, cluster),
                           pp=pp, dp=dp, schedule="1f1b", micro_batches="2", micro_batch_size=1,
                           seq_len=seq_len)
    return Plan(layout=layout, cluster=cluster)


def test_a_model_larger_than_this_machine_is_refused_at_once() -> None:
    started = time.perf_counter()
    with pytest.raises(MedleyInputError, match=r"GiB of memory .* available") as err:
        preflight(plan_for("llama-2-70b", seq_len=256), dtype="fp32", local_ranks=1, on_cuda=False)
    assert time.perf_counter() - started < 10
    assert "\n" not in str(err.value)


def test_tiny_fits_and_the_check_counts_every_local_rank() -> None:
    plan = plan_for("tiny", pp=2, dp=2)
    preflight(plan, dtype="fp32", local_ranks=4, on_cuda=False)
    peaks = predicted_peaks(plan, dtype="fp32")
    assert sorted(peaks) == [0, 1, 2, 3] and all(p > 0 for p in peaks.values())
    needed = sum(peaks.values()) + 4 * RANK_BASE_BYTES
    check_cpu_memory(plan, dtype="fp32", local_ranks=4, available=int(needed) + 1)
    with pytest.raises(MedleyInputError, match="4 rank"):
        check_cpu_memory(plan, dtype="fp32", local_ranks=4, available=int(needed) - 1)


def test_fp32_needs_more_than_bf16() -> None:
    plan = plan_for("tiny", pp=2)
    fp32, bf16 = predicted_peaks(plan, dtype="fp32"), predicted_peaks(plan, dtype="bf16")
    assert all(fp32[d] > bf16[d] for d in fp32)


def test_a_sequence_longer_than_the_model_is_refused() -> None:
    limit = get_model("tiny").max_seq_len
    with pytest.raises(MedleyInputError, match=rf"--seq-len {limit} or less"):
        preflight(plan_for("tiny", seq_len=1000), dtype="fp32", local_ranks=1, on_cuda=False)


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "llama-2-70b", "--seq-len", "256"], "GiB of memory"),
    (["--model", "tiny", "--seq-len", "1000"], "use --seq-len 128 or less"),
])
def test_train_refuses_before_any_rank_starts(args: list[str], expected: str) -> None:
    from typer.testing import CliRunner

    from medley.cli.main import app

    started = time.perf_counter()
    result = CliRunner().invoke(app, ["train", "--local-ranks", "1", "--steps", "1", *args],
                                env={"COLUMNS": "1000"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]
    assert time.perf_counter() - started < 20


def test_on_cuda_each_rank_checks_the_plan_device_it_is_placed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun a rank's device comes from the placement (LOCAL_RANK i: the i-th plan device
    here), not from the row-major order: with assignment 1,0, rank 0 on local rank 0 is plan device 0,
    which runs pipeline rank 1 (row-major would say device 1). The GPU's size is the one stand-in
    (this machine has none)."""
    import types

    import torch

    cluster, spec = parse_cluster_arg("2xA100-80GB"), get_model("tiny")
    layout = inline_layout(cluster=cluster, model=spec, cost=CatalogCostSource.for_cluster(spec, cluster),
                           pp=2, dp=1, schedule="1f1b", micro_batches="2", micro_batch_size=1, seq_len=64,
                           assignment="1,0")
    plan = Plan(layout=layout, cluster=cluster)
    monkeypatch.delenv("MEDLEY_NODE", raising=False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(total_memory=1))
    with pytest.raises(MedleyInputError) as err:
        preflight(plan, dtype="fp32", local_ranks=2, on_cuda=True)
    assert "rank 0 runs plan device 0 " in str(err.value) and "cuda:0 has 0.0 GiB" in str(err.value)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(total_memory=80 * 2**30))
    preflight(plan, dtype="fp32", local_ranks=2, on_cuda=True)
