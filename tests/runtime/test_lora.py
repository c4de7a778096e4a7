"""LoRA adapters in the runtime (gloo, CPU): every plan shape trains as the single-process
reference does (fp32, 1e-5), the base stays as it started, checkpoints hold the adapters alone and
a resume continues the same losses; the flags and the plan file carry the adapter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from train_plans import config, stop_after_step_3, tiny_plan, tp_plan

from medley.cli.train_cmd import adapter_lines
from medley.errors import MedleyInputError
from medley.launch.spawn import RankFailure, train_local
from medley.plan.plan import Plan, plan_from_dict, plan_to_dict
from medley.runtime.checkpoint_layout import latest_checkpoint
from medley.runtime.config import TrainHooks
from medley.runtime.hf_export import read_model_tensors
from medley.runtime.lora import is_adapter_name
from medley.runtime.reference import reference_run
from medley.runtime.transformer import Decoder
from medley.spec.adapter import LoraSpec, lora_of, parse_targets
from medley.spec.model_arg import get_model

TOL = 1e-5
LORA = LoraSpec(rank=4, alpha=8.0, targets=("wq", "wv", "wo", "gate", "down"))


def _lora(plan: Plan, lora: LoraSpec = LORA) -> Plan:
    return dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, adapter=lora))


def _close(records: list, want: list[float]) -> bool:
    return max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL


@pytest.mark.timeout(300)
def test_lora_on_pp2_dp2_zero3_trains_as_the_reference_and_leaves_the_base(tmp_path: Path) -> None:
    plan = _lora(tiny_plan(pp=2, dp=2, split="3,3", zero="3,3", schedule="1f1b", micro_batches="3,2"))
    settings = config(steps=4, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    want = reference_run(plan.layout, settings)
    records = train_local(plan, settings)
    assert _close(records, want.losses)
    assert records[-1].loss < records[0].loss - 0.005, "the adapters must learn"
    # The reference's base is the seeded model's, untouched; its adapters moved.
    start = Decoder(plan.layout.model, seed=settings.data.seed, adapter=LORA)
    trained = dict(want.model.named_parameters())
    moved = {name for name, param in start.named_parameters() if not torch.equal(param, trained[name])}
    assert moved and all(is_adapter_name(name) for name in moved), sorted(moved)[:3]
    # The checkpoint holds the adapters (and their optimizer state), not the base.
    _, saved, _ = read_model_tensors(latest_checkpoint(tmp_path / "ckpt"))
    assert saved and all(is_adapter_name(name) for name in saved)
    assert all(torch.allclose(saved[n], trained[n], atol=TOL) for n in saved)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_lora_under_tp2_trains_as_the_reference(sequence_parallel: bool) -> None:
    plan = _lora(tp_plan(tp=(2,), dp=2, split="6", zero="1", schedule="1f1b", micro_batches="2",
                         recompute=True, sequence_parallel=sequence_parallel),
                 dataclasses.replace(LORA, targets=("wq", "wk", "wv", "wo", "gate", "up", "down")))
    settings = config(steps=3, checkpoint_every=0)
    assert _close(train_local(plan, settings), reference_run(plan.layout, settings).losses)


@pytest.mark.timeout(300)
def test_a_lora_run_resumes_to_the_same_losses(tmp_path: Path) -> None:
    plan = _lora(tiny_plan(pp=2, dp=1, split="2,4", zero="0,1", schedule="zb-h1", micro_batches="4"))
    want = reference_run(plan.layout, config()).losses
    stopped = config(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, measure_memory=False)
    with pytest.raises(RankFailure, match="StopTraining"):
        train_local(plan, stopped, hooks=TrainHooks(on_step=stop_after_step_3))
    resumed = train_local(plan, config(checkpoint_dir=tmp_path / "ckpt", measure_memory=False))
    assert [r.step for r in resumed] == [4, 5]
    assert _close(resumed, want[4:])
    other = _lora(plan, dataclasses.replace(LORA, rank=8))
    with pytest.raises(MedleyInputError, match="written with adapter = .*'rank': 4.* change --lora-"):
        train_local(other, config(checkpoint_dir=tmp_path / "ckpt", steps=8, measure_memory=False))


def test_the_flags_and_the_plan_file_carry_the_adapter() -> None:
    model = get_model("tiny")
    assert lora_of(rank=0, alpha=16, dropout=0, targets="all", model=model) is None
    lora = lora_of(rank=8, alpha=16, dropout=0.05, targets="q_proj,v,o", model=model)
    assert lora == LoraSpec(rank=8, alpha=16.0, dropout=0.05, targets=("wq", "wv", "wo"))
    assert lora.scale == 2.0
    assert parse_targets("all") == ("wq", "wk", "wv", "wo", "gate", "up", "down")
    with pytest.raises(MedleyInputError, match="--lora-targets 'q,x': unknown layer x"):
        parse_targets("q,x")
    with pytest.raises(MedleyInputError, match="--lora-rank -1"):
        lora_of(rank=-1, alpha=16, dropout=0, targets="all", model=model)
    with pytest.raises(MedleyInputError, match="--lora-rank: model 'gpt-neo"):
        lora_of(rank=4, alpha=16, dropout=0, targets="all", model=get_model("gpt-neo-2.7b"))
    plan = _lora(tiny_plan(pp=2, dp=1, split="3,3", zero="1,1", schedule="1f1b", micro_batches="2"), lora)
    data = plan_to_dict(plan)
    assert data["layout"]["adapter"] == {"rank": 8, "alpha": 16.0, "dropout": 0.05,
                                         "targets": ["wq", "wv", "wo"]}
    assert plan_from_dict(data, source="p.toml").layout.adapter == lora
    # 8 x (64 + 64) + 8 x (64 + 32) + 8 x (64 + 64) per block, 4 blocks.
    assert adapter_lines(plan) == ["LoRA rank 8 (alpha 16) on wq, wv, wo: 11,264 trainable parameters "
                                   "(4.92% of the model); the base is frozen"]
    bad = {**data, "layout": {**data["layout"], "adapter": {**data["layout"]["adapter"], "targets": ["qq"]}}}
    with pytest.raises(MedleyInputError, match="p.toml"):
        plan_from_dict(bad, source="p.toml")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_simulator_books_a_lora_run_as_the_runtime_holds_it(dtype: str) -> None:
    """A frozen base keeps no gradient and no optimizer state (and in half precision no fp32
    master): the measured peak drops, and the simulator's peak (medley.cost.zero_memory.
    adapted_state_bytes) follows it as closely as it follows full training (within 16% per device
    here, where fixed buffers it does not book weigh as much as the model)."""
    from medley.cli.preflight import predicted_peaks

    base = tiny_plan(pp=2, dp=2, split="3,3", zero="3,3", schedule="1f1b", micro_batches="2,2")
    base = dataclasses.replace(base, layout=dataclasses.replace(base.layout, dtype=dtype))
    measured, predicted = {}, {}
    for lora in (None, LoraSpec(rank=4)):
        plan = _lora(base, lora) if lora else base
        records = train_local(plan, config(steps=2, checkpoint_every=0, dtype=dtype))
        measured[lora], predicted[lora] = records[-1].peak_memory_bytes, predicted_peaks(plan, dtype=dtype)
    for lora in measured:
        for device, got in measured[lora].items():
            assert abs(predicted[lora][device] - got) <= 0.16 * got, (lora, device)
    adapted = measured[LoraSpec(rank=4)]
    assert all(adapted[d] < 0.9 * measured[None][d] for d in adapted)
    assert all(predicted[LoraSpec(rank=4)][d] < 0.9 * predicted[None][d] for d in adapted)
