"""bench/published.py: its data file keeps the promised shape (rows, sources, GPU types, both
halves), each row's arithmetic agrees, and a few rows predict through medley's simulator."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from published import (  # noqa: E402
    HALVES,
    base_type,
    load_runs,
    markdown,
    narayanan_flops_per_step,
    predict,
    summarise,
)

from medley.cost.formulas import megatron_flops_per_step  # noqa: E402


def test_the_table_has_twenty_rows_from_three_sources_on_three_gpu_types() -> None:
    runs, data = load_runs()
    assert len(runs) >= 20
    assert len({r.source for r in runs}) >= 3
    assert len({base_type(r.gpu, data.get("device_types", {})) for r in runs}) >= 3
    assert {r.half for r in runs} == set(HALVES)
    assert len({r.id for r in runs}) == len(runs)
    for key, source in data["sources"].items():
        assert source["cite"] and source["config"] and source["hardware"], key
    for run in runs:
        assert run.dp * run.tp * run.pp == run.gpus and run.measured_tokens_per_s > 0


def test_narayanan_counts_megatron_flops_plus_the_recomputation_forward() -> None:
    # Their Eq. 3 is Megatron's count (no recomputation) plus one more forward of the blocks.
    runs, _ = load_runs()
    run = next(r for r in runs if r.source == "narayanan2021")
    m, b, s = run.model, run.global_batch, run.seq_len
    head = 6.0 * b * s * m.vocab_size * m.hidden_size
    megatron = megatron_flops_per_step(m, batch_size=b, seq_len=s)
    assert narayanan_flops_per_step(m, global_batch=b, seq_len=s) == pytest.approx(
        megatron + (megatron - head) / 3)


def test_a_few_rows_predict_and_report() -> None:
    runs, data = load_runs()
    ids = {"mpt-7b-h100-8gpu", "megatron-39.1b-512gpu", "torchtitan-llama3-8b-8gpu"}
    chosen = [r for r in runs if r.id in ids]
    rows = [predict(run, data.get("device_types", {})) for run in chosen]
    assert len(rows) == 3
    for row in rows:
        assert row["predicted_tokens_per_s"] > 0 and row["ratio"] == pytest.approx(
            row["predicted_tokens_per_s"] / row["measured_tokens_per_s"])
    summary = summarise(rows)
    everything = summary["all"]
    assert everything["rows"] == 3 and everything["worst_abs_error"] >= everything["median_abs_error"]
    text = markdown({"commit": "c", "command": "python bench/published.py", "sources": data["sources"],
                     "summary": summary, "rows": rows})
    assert all(row["id"] in text for row in rows)
