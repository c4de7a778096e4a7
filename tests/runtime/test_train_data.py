"""Training on data sets, launched (gloo, CPU): a tokenized jsonl, a parquet directory and a .bin
token file on a pp2 x dp2 plan (ZeRO 3,1) equal the single-process reference, losses and validation losses;
a resumed run continues at the exact next sample; TensorBoard receives the scalars."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from data_sets import DOCS, write_jsonl
from train_plans import config, tiny_plan

from medley.launch.spawn import train_local
from medley.runtime.checkpoint_layout import checkpoint_path
from medley.runtime.reference import reference_run

TOL = 1e-5
PLAN = dict(pp=2, dp=2, split="3,3", zero="3,1", schedule="1f1b", micro_batches="3,2")
# Another schedule (split backward) and ZeRO levels for the forward-only evaluation.
PLAN_ZB = dict(pp=2, dp=2, split="2,4", zero="1,3", schedule="zb-h1", micro_batches="2,3", buckets=2)


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory, bpe_tokenizer) -> dict:
    """Six steps on a tokenized jsonl, 10% held out, evaluated every 2 steps, checkpoints every 3."""
    root = tmp_path_factory.mktemp("jsonl_run")
    data = write_jsonl(root / "docs.jsonl", DOCS * 4)
    settings = dict(data=str(data), tokenizer=str(bpe_tokenizer), data_cache=root / "cache", val_fraction=0.1,
                    eval_every=2, eval_batches=2, checkpoint_every=3)
    records = train_local(tiny_plan(**PLAN), config(**settings, checkpoint_dir=root / "ckpt",
                                                    log_jsonl=root / "log.jsonl", tensorboard=root / "tb"))
    return {"root": root, "settings": settings, "records": records}


@pytest.mark.timeout(300)
def test_tokenized_jsonl_matches_the_reference_with_eval_losses(jsonl_run) -> None:
    records, settings = jsonl_run["records"], jsonl_run["settings"]
    want = reference_run(tiny_plan(**PLAN).layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    got = {r.step: r.eval_loss for r in records if r.eval_loss is not None}
    assert sorted(got) == sorted(want.eval_losses) == [1, 3, 5]
    assert max(abs(got[s] - want.eval_losses[s]) for s in got) <= TOL
    assert got[5] < got[1]  # the model learns
    logged = [json.loads(line) for line in (jsonl_run["root"] / "log.jsonl").read_text().splitlines()]
    assert [row.get("eval_loss") is not None for row in logged if "step" in row] == [False, True] * 3
    assert set(records[0].step_time_by_device) == {0, 1, 2, 3}
    for r in records:  # each rank's step splits into its actions' kinds
        for d in range(4):
            parts = r.action_time_by_device[d]
            assert parts["compute"] > 0 and parts["optim"] > 0
            assert sum(parts.values()) <= r.step_time_by_device[d]


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_at_the_next_sample(jsonl_run, tmp_path) -> None:
    """From the step-3 checkpoint: steps 3-5 equal the uninterrupted run bit for bit (their batches
    are the same samples: a different sample would change the loss)."""
    root, settings = jsonl_run["root"], jsonl_run["settings"]
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    shutil.rmtree(checkpoint_path(tmp_path / "ckpt", 6))
    records = train_local(tiny_plan(**PLAN), config(**settings, checkpoint_dir=tmp_path / "ckpt"))
    assert [r.step for r in records] == [3, 4, 5]
    assert [r.loss for r in records] == [r.loss for r in jsonl_run["records"][3:]]
    assert [r.eval_loss for r in records] == [r.eval_loss for r in jsonl_run["records"][3:]]


@pytest.mark.timeout(120)
def test_tensorboard_has_the_scalars(jsonl_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(jsonl_run["root"] / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss",
            "train/step_time_s/device_3"} <= tags
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx([r.loss for r in jsonl_run["records"]], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4, 6], "steps done, as checkpoints count"
    assert [e.step for e in events.Scalars("train/loss")] == [r.step + 1 for r in jsonl_run["records"]]


@pytest.mark.timeout(300)
def test_a_bin_token_file_with_val_data_matches_the_reference_under_zb_h1(tmp_path) -> None:
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 20_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 256, 2_000, dtype=np.uint16).tofile(tmp_path / "val.bin")
    settings = dict(data=str(tmp_path / "train.bin"), val_data=str(tmp_path / "val.bin"), eval_every=3,
                    steps=3, checkpoint_every=0, measure_memory=False)
    records = train_local(tiny_plan(**PLAN_ZB), config(**settings))
    want = reference_run(tiny_plan(**PLAN_ZB).layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    assert abs(records[-1].eval_loss - want.eval_losses[2]) <= TOL


@pytest.mark.timeout(300)
def test_a_parquet_directory_matches_the_reference(tmp_path, bpe_tokenizer) -> None:
    """The issue's third input kind on the same pp2 x dp2 ZeRO 3,1 plan: a directory of parquet
    files (read in name order), tokenized with the BPE tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "docs").mkdir()
    half = len(DOCS) * 2
    pq.write_table(pa.table({"text": (DOCS * 4)[:half]}), tmp_path / "docs" / "0.parquet")
    pq.write_table(pa.table({"text": (DOCS * 4)[half:]}), tmp_path / "docs" / "1.parquet")
    settings = dict(data=str(tmp_path / "docs"), tokenizer=str(bpe_tokenizer), data_cache=tmp_path / "cache",
                    steps=3, checkpoint_every=0, measure_memory=False)
    records = train_local(tiny_plan(**PLAN), config(**settings))
    want = reference_run(tiny_plan(**PLAN).layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
