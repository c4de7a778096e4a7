"""fp16 with dynamic loss scaling (issue #12, item 3) on CPU autocast fp16 (torch 2.13 autocasts
matmuls to fp16 on CPU): close to fp32, an overflow anywhere skips the step on every rank and
halves the scale everywhere, the scale survives a resume, and a run never changes precision
without saying so.

The overflow is injected through ``TrainHooks.grad_hook`` (a test hook the ranks call right
before the step's global gradient check); the same hook writes what every rank saw to a file,
so the tests check every rank, not only rank 0's records.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from train_plans import config, stop_after_step_3, tiny_plan

from medley.cli.preflight import precision_note
from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.launch.spawn import RankFailure, train_local
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan, save_plan
from medley.runtime.config import TrainConfig, TrainHooks, check_config
from medley.runtime.optim import lr_at
from medley.runtime.precision import LossScaler, choose_dtype
from medley.runtime.reference import reference_losses
from medley.runtime.sharding import ShardedStage
from medley.runtime.train import train
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

INIT = 2.0**16
# 4 ranks: zero-bubble (split backward of the scaled loss), ZeRO-3 and ZeRO-1 stages, uneven replicas.
PLAN_A = dict(pp=2, dp=2, split="3,3", zero="3,1", schedule="zb-h1", micro_batches="5,3", buckets=2)
# 2 ranks: one pipeline, ZeRO-2 then ZeRO-0.
PLAN_B = dict(pp=2, dp=1, split="2,4", zero="2,0", schedule="1f1b", micro_batches="8")


def watch_and_inject(step: int, stages: dict[int, ShardedStage], scale: float | None, *, directory: str,
                     inject_step: int = -1, inject_rank: str = "", inject_stage: int = -1) -> None:
    """Test hook: log what this rank sees before the step's gradient check (its loss scale, its
    optimizer steps so far, a checksum of its weights), then, on ``inject_rank`` at
    ``inject_step``, put an inf into one gradient of ``inject_stage``."""
    rank = os.environ["RANK"]
    counts = [float(state["step"]) for stage in stages.values() for optimizer in stage.optimizers
              for state in optimizer.state.values() if "step" in state]
    weights = sum(float((p.to_local() if hasattr(p, "to_local") else p).double().sum())
                  for stage in stages.values() for _, p in stage.named_parameters_local())
    with open(Path(directory) / f"rank{rank}.jsonl", "a") as handle:
        handle.write(json.dumps({"step": step, "scale": scale, "adam_steps": max(counts, default=0.0),
                                 "weights": weights}) + "\n")
    if step == inject_step and rank == inject_rank and inject_stage in stages:
        grad = stages[inject_stage].final_grads()[0]
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf


def seen(directory: Path) -> dict[str, list[dict]]:
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(directory.glob("rank*.jsonl"))}


@pytest.mark.timeout(300)
def test_fp16_stays_within_3_percent_of_fp32_for_20_steps() -> None:
    plan = tiny_plan(**PLAN_A)
    records = train_local(plan, config(steps=20, dtype="fp16", checkpoint_every=0, measure_memory=False))
    want = reference_losses(plan.layout, config(steps=20))
    assert [r.step for r in records] == list(range(20))
    assert max(abs(r.loss - w) / w for r, w in zip(records, want, strict=True)) <= 0.03
    assert records[-1].loss < 0.7 * records[0].loss  # it learns
    assert all(r.loss_scale == INIT and r.skipped_steps == 0 for r in records)


@pytest.mark.timeout(300)
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(tmp_path: Path) -> None:
    """inf in stage 1's gradient on global rank 3 only (replica 1, a ZeRO-1 stage whose norm only
    replica 0 counts) at step 2: every rank skips step 2 (no weight, no AdamW step changes), every
    rank halves the scale, the learning-rate schedule waits a step and the run goes on."""
    hook = functools.partial(watch_and_inject, directory=str(tmp_path), inject_step=2, inject_rank="3",
                             inject_stage=1)
    plan = tiny_plan(**PLAN_A)
    records = train_local(plan, config(steps=5, dtype="fp16", checkpoint_every=0, measure_memory=False),
                          hooks=TrainHooks(grad_hook=hook))
    assert [r.skipped_steps for r in records] == [0, 0, 1, 1, 1]
    assert [r.loss_scale for r in records] == [INIT, INIT, INIT, INIT / 2, INIT / 2]
    assert math.isinf(records[2].grad_norm)
    assert all(math.isfinite(r.grad_norm) for r in records if r.step != 2)
    assert records[3].lr == records[2].lr == lr_at(2, lr=3e-3, min_lr=3e-4, warmup_steps=2, total_steps=5)
    ranks = seen(tmp_path)
    assert sorted(ranks) == ["rank0", "rank1", "rank2", "rank3"]
    for rank, steps in ranks.items():
        assert [s["step"] for s in steps] == list(range(5)), rank
        assert [s["scale"] for s in steps] == [INIT, INIT, INIT, INIT / 2, INIT / 2], rank
        assert [s["adam_steps"] for s in steps] == [0, 1, 2, 2, 3], rank  # step 2 applied nothing
        assert steps[3]["weights"] == steps[2]["weights"] != steps[1]["weights"], rank


@pytest.mark.timeout(300)
def test_resume_restores_the_scale_its_growth_and_the_skip_count(tmp_path: Path) -> None:
    """Overflow at step 1, the scale grows again after three good steps (after step 4). A run
    stopped after step 3 resumes at step 4 with the halved scale, the good-step count and the
    skip count of its checkpoint: its steps 4 and 5 equal the uninterrupted run's bit for bit."""
    def run(directory: Path, on_step: Callable[[int], None] | None = None) -> list:
        hook = functools.partial(watch_and_inject, directory=str(tmp_path), inject_step=1, inject_rank="1",
                                 inject_stage=1)
        return train_local(tiny_plan(**PLAN_B), config(
            dtype="fp16", checkpoint_dir=directory, measure_memory=False, loss_scale_growth_interval=3),
            hooks=TrainHooks(grad_hook=hook, on_step=on_step))

    whole = run(tmp_path / "whole")
    assert [r.loss_scale for r in whole] == [INIT, INIT, INIT / 2, INIT / 2, INIT / 2, INIT]
    assert [r.skipped_steps for r in whole] == [0, 1, 1, 1, 1, 1]
    with pytest.raises(RankFailure, match="StopTraining"):
        run(tmp_path / "stopped", on_step=stop_after_step_3)
    resumed = run(tmp_path / "stopped")
    assert [r.step for r in resumed] == [4, 5]
    assert [(r.loss, r.lr, r.loss_scale, r.skipped_steps) for r in resumed] == [
        (r.loss, r.lr, r.loss_scale, r.skipped_steps) for r in whole[4:]]


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


ONE_RANK = dict(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2")


@pytest.mark.timeout(120)
def test_a_non_finite_loss_still_stops_an_fp16_run(one_rank_group) -> None:
    with pytest.raises(MedleyInputError, match="training diverged"):
        train(tiny_plan(**ONE_RANK), config(steps=20, lr=100.0, dtype="fp16", checkpoint_every=0,
                                            measure_memory=False))


@pytest.mark.timeout(120)
def test_an_fp16_run_resumes_a_checkpoint_without_a_scale(one_rank_group, tmp_path: Path) -> None:
    """A checkpoint of an fp32 run has no loss scale: fp16 starts from its initial scale."""
    plan, directory = tiny_plan(**ONE_RANK), tmp_path / "ckpt"
    train(plan, config(steps=2, checkpoint_dir=directory, measure_memory=False))
    records = train(plan, config(steps=3, dtype="fp16", checkpoint_dir=directory, measure_memory=False,
                                 loss_scale_init=1024.0, extend_schedule=True))
    assert [(r.step, r.loss_scale, r.skipped_steps) for r in records] == [(2, 1024.0, 0)]


def overflow_flags() -> st.SearchStrategy[list[bool]]:
    return st.lists(st.booleans(), max_size=40)


@settings(max_examples=30, deadline=None)
@given(flags=overflow_flags(), interval=st.integers(1, 4))
def test_the_scale_follows_torch_grad_scaler(flags: list[bool], interval: int) -> None:
    """Any sequence of overflowing and finite steps moves the scale as torch's GradScaler does."""
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    reference = torch.amp.GradScaler("cpu", init_scale=INIT, growth_factor=2.0, backoff_factor=0.5,
                                     growth_interval=interval)
    ours = LossScaler(scale=INIT, growth_interval=interval)
    for overflow in flags:
        reference.scale(torch.ones(()))  # GradScaler starts counting at its first scale()
        param.grad = torch.full((1,), math.inf if overflow else 1.0)
        reference.step(optimizer)
        reference.update()
        ours.update(finite=not overflow)
        assert ours.scale == reference.get_scale()
    assert ours.skipped_steps == sum(flags)


def v100_plan() -> Plan:
    cluster, model = parse_cluster_arg("2xV100-32GB"), get_model("opt-350m")
    layout = inline_layout(cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster),
                           pp=2, dp=1, schedule="1f1b", micro_batches="4", micro_batch_size=2, seq_len=512,
                           split=None, zero="0")
    return Plan(layout=layout, cluster=cluster)


def seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"s": 1.0, "ms": 1e-3}[unit]


def test_a_run_in_another_precision_says_so_with_the_repredicted_step_time() -> None:
    plan = v100_plan()
    assert plan.layout.dtype == "fp16"  # V100 has no bf16
    assert choose_dtype(plan, None, on_cuda=True) == "fp16"
    assert choose_dtype(plan, None, on_cuda=False) == "fp32"
    assert choose_dtype(plan, "bf16", on_cuda=True) == "bf16"
    assert precision_note(plan, "fp16", chosen=False) is None
    note = precision_note(plan, "fp32", chosen=False)
    assert note is not None and "\n" not in note
    assert note.startswith("precision: the plan trains in fp16 but this run computes in fp32 (the default "
                           "on CPU; --dtype sets it); predicted step time ")
    fp32_time, fp16_time = (seconds(part.split(" in ")[0]) for part in
                            note.split("predicted step time ")[1].split(" against "))
    assert fp32_time > 4 * fp16_time > 0  # V100: 15.7 fp32 against 125 fp16 TFLOP/s
    assert "(--dtype bf16)" in (precision_note(plan, "bf16", chosen=True) or "")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("dtype", "fp8", "--dtype 'fp8' must be fp32, bf16 or fp16"),
    ("loss_scale_init", math.inf, "loss_scale_init inf must be a finite number > 0"),
    ("loss_scale_backoff", 1.0, "loss_scale_backoff 1.0 must be in (0, 1)"),
    ("loss_scale_growth", 0.5, "loss_scale_growth 0.5 must be a finite number >= 1"),
    ("loss_scale_growth_interval", 0, "loss_scale_growth_interval 0 must be >= 1"),
])
def test_bad_precision_settings_are_one_line(field: str, value: object, message: str) -> None:
    with pytest.raises(MedleyInputError) as caught:
        check_config(TrainConfig.of(**{field: value}))
    assert message in str(caught.value) and "\n" not in str(caught.value)
    check_config(TrainConfig.of(dtype="fp16"))


MEDLEY = str(Path(sys.executable).with_name("medley"))
RUN = ["train", "--local-ranks", "1", "--steps", "2", "--json", "--device", "cpu"]  # a V100 plan, on this CPU
ON_CPU = "device: this machine (playing every node) runs the plan's 1 x V100-32GB (device 0) on the CPU"


def v100_plan_file(directory: Path) -> Path:
    """A one-rank fp16 plan (V100 has no bf16) of the tiny model, saved as `medley plan` saves one."""
    cluster, model = parse_cluster_arg("1xV100-32GB"), get_model("tiny")
    layout = inline_layout(cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster),
                           pp=1, dp=1, schedule="1f1b", micro_batches="2", micro_batch_size=2, seq_len=32,
                           split="4", zero="0")
    path = directory / "v100.json"
    save_plan(Plan(layout=layout, cluster=cluster), path)
    return path


@pytest.mark.timeout(300)
def test_medley_train_says_when_it_changes_the_plans_precision(tmp_path: Path) -> None:
    """An fp16 plan file (V100) trained on CPU (--device cpu, said in the first line): rank 0 then
    prints one line (fp32 here, the plan fp16, both step times); with --dtype fp16 it trains in fp16
    and says nothing more; every record has the scale. An inline plan is made in the precision the
    run computes in, so it never gets the line."""
    plan = str(v100_plan_file(tmp_path))
    default = subprocess.run([MEDLEY, *RUN, "--plan", plan], capture_output=True, text=True, timeout=200)
    assert default.returncode == 0, default.stderr
    lines = [line for line in default.stderr.splitlines() if line.strip()]
    note = "precision: the plan trains in fp16 but this run computes in fp32 (the default on CPU"
    assert len(lines) == 2 and lines[0].startswith(ON_CPU) and lines[1].startswith(note), default.stderr
    assert all(r["loss_scale"] is None and r["skipped_steps"] == 0 for r in run_records(default.stdout))
    fp16 = subprocess.run([MEDLEY, *RUN, "--plan", plan, "--dtype", "fp16"], capture_output=True, text=True,
                          timeout=200)
    assert fp16.returncode == 0 and fp16.stderr.strip().startswith(ON_CPU), fp16.stderr
    assert len(fp16.stderr.strip().splitlines()) == 1, fp16.stderr
    assert [r["loss_scale"] for r in run_records(fp16.stdout)] == [INIT, INIT]
    inline = subprocess.run([MEDLEY, *RUN, "--cluster", "1xV100-32GB", "--split", "4", "--micro-batches", "2",
                             "--seq-len", "32"], capture_output=True, text=True, timeout=200)
    assert inline.returncode == 0 and inline.stderr.strip().startswith(ON_CPU), inline.stderr
    assert len(inline.stderr.strip().splitlines()) == 1, inline.stderr
    assert all(r["loss_scale"] is None for r in run_records(inline.stdout))


def run_records(stdout: str) -> list[dict]:
    out = json.loads(stdout)
    return out["records"] if isinstance(out, dict) else out
