"""Tied embeddings on any pipeline depth: the first stage's embedding and the last stage's head
copy take summed gradients, so training equals the single-process reference (AdamW, clipping)
and both copies stay bit-identical, whatever the pp, dp, ZeRO levels, schedule and assignment."""

from __future__ import annotations

import dataclasses
import functools
import shutil
from pathlib import Path

import pytest
import torch
from train_plans import config, save_tied_copies, tied_tiny, tiny_plan, tp_plan

from medley.launch.spawn import train_local
from medley.plan.plan import Plan
from medley.plan.world import build_schedules
from medley.runtime.checkpoint_layout import checkpoint_path
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.reference import reference_losses
from medley.runtime.train import TrainHooks
from medley.runtime.transformer import Decoder, shared_name
from medley.schedule.ir import Kind

TOL = 1e-5
STEPS = 4
PLANS = {
    "pp2-dp1": dict(pp=2, dp=1, split="3,3", zero="0,0", schedule="1f1b", micro_batches="4"),
    "pp2-dp2-zero31": dict(pp=2, dp=2, split="3,3", zero="3,1", schedule="1f1b", micro_batches="3,2",
                           buckets=2),
    "pp2-dp2-zero03": dict(pp=2, dp=2, split="3,3", zero="0,3", schedule="1f1b", micro_batches="2,2"),
    "pp2-dp2-zero23": dict(pp=2, dp=2, split="2,4", zero="2,3", schedule="zb-h1", micro_batches="3,3"),
    "interleaved-pp2-v2": dict(pp=2, dp=1, split="2,1,1,2", zero="1,0,0,1", schedule="interleaved",
                               virtual_stages=2, micro_batches="4"),
    # One rank holds the first and the last stage: the sum is local.
    "interleaved-pp1-v2": dict(pp=1, dp=1, split="3,3", zero="0,0", schedule="interleaved",
                               virtual_stages=2, micro_batches="4"),
    "interleaved-pp1-v2-dp2-zero31": dict(pp=1, dp=2, split="3,3", zero="3,1", schedule="interleaved",
                                          virtual_stages=2, micro_batches="2,2"),
    "pp2-assignment-1,0": dict(pp=2, dp=1, split="3,3", zero="0,0", schedule="1f1b", micro_batches="4",
                               assignment="1,0"),
}


def copies_by_step(directory: Path) -> dict[int, list[dict[str, torch.Tensor]]]:
    found: dict[int, list[dict[str, torch.Tensor]]] = {}
    for path in sorted(directory.glob("step*.pt")):
        step = int(path.name.split("-")[0].removeprefix("step"))
        found.setdefault(step, []).append(torch.load(path))
    return found


def check_tied_run(plan: Plan, directory: Path) -> list:
    """Train ``plan`` (tied tiny) for :data:`STEPS` steps: the losses equal the one-process
    reference, and every copy of the tied weight (each end's, on every TP rank of every replica)
    holds the same weight and summed gradient, bit for bit, at every step. Returns the records."""
    hook = functools.partial(save_tied_copies, str(directory))
    records = train_local(plan, config(steps=STEPS, checkpoint_every=0, measure_memory=False),
                          hooks=TrainHooks(grad_hook=hook))
    want = reference_losses(plan.layout, config(steps=STEPS))
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    found = copies_by_step(directory)
    assert sorted(found) == list(range(STEPS))
    layout = plan.layout
    ends = layout.stage_tp(0) + layout.stage_tp(layout.num_stages - 1)
    for step, copies in found.items():
        assert len(copies) == layout.dp * ends, f"step {step}: {len(copies)} copies"
        for copy in copies[1:]:
            assert torch.equal(copy["param"], copies[0]["param"]), f"step {step}: the copies differ"
            assert torch.equal(copy["grad"], copies[0]["grad"]), f"step {step}: the gradients differ"
    return records


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(PLANS))
def test_tied_pipeline_matches_the_reference(name: str, tmp_path: Path) -> None:
    records = check_tied_run(tiny_plan(model=tied_tiny(), **PLANS[name]), tmp_path)
    assert records[0].grad_norm > 1.0, "clipping must be active in this test"


@pytest.mark.timeout(240)
def test_tied_norm_counts_the_weight_once_without_clipping() -> None:
    """Without --clip-norm the schedule still carries CLIP (the tied sum happens there); the
    recorded gradient norm and the losses equal the one-stage run's."""
    no_clip = config(steps=2, checkpoint_every=0, measure_memory=False, clip_norm=None)
    one = train_local(tiny_plan(model=tied_tiny(), pp=1, dp=1, split="6", zero="0", schedule="1f1b",
                                micro_batches="4"), no_clip)
    two = train_local(tiny_plan(model=tied_tiny(), **PLANS["pp2-dp1"]), no_clip)
    for a, b in zip(one, two, strict=True):
        assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * a.grad_norm
        assert abs(a.loss - b.loss) <= TOL


def test_every_rank_of_a_tied_pipeline_has_a_clip_action() -> None:
    """The simulator and the runtime share the schedule: both carry the CLIP barrier."""
    plan = tiny_plan(model=tied_tiny(), **PLANS["pp2-dp2-zero31"])
    assert not plan.layout.clip_grad and plan.layout.tied_copies
    for schedule in build_schedules(plan.layout):
        assert all(sum(a.kind is Kind.CLIP for a in row) == 1 for row in schedule.actions)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("saved", "resumed"), [("pp1", "pp2-dp2-zero03"), ("pp2-dp2-zero03", "pp2-dp1"),
                                               ("pp2-dp2-zero31", "interleaved-pp1-v2-dp2-zero31")])
def test_tied_checkpoint_resumes_under_another_plan(saved: str, resumed: str, tmp_path: Path) -> None:
    """The tied weight is saved once, as the embedding's, and loads into either copy on any plan."""
    plans = {**PLANS, "pp1": dict(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="4")}
    plans["interleaved-pp1-v2-dp2-zero31"]["micro_batches"] = "3,2"  # the saved run's global batch
    directory = tmp_path / "ckpt"
    first = train_local(tiny_plan(model=tied_tiny(), **plans[saved]),
                        config(steps=STEPS, checkpoint_dir=directory, measure_memory=False))
    step = checkpoint_path(directory, 4)
    keys = SafeReader(step).read_metadata().state_dict_metadata
    assert "model.embed.tok.weight" in keys and not any("head.out" in key for key in keys)
    shutil.rmtree(step)
    hooked = tmp_path / "copies"
    hooked.mkdir()
    second = train_local(tiny_plan(model=tied_tiny(), **plans[resumed]),
                         config(steps=STEPS, checkpoint_dir=directory, measure_memory=False),
                         hooks=TrainHooks(grad_hook=functools.partial(save_tied_copies, str(hooked))))
    assert [r.step for r in second] == [2, 3]
    assert max(abs(a.loss - b.loss) for a, b in zip(first[2:], second, strict=True)) <= TOL
    for copies in copies_by_step(hooked).values():
        assert all(torch.equal(c["param"], copies[0]["param"]) for c in copies)


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_the_head_copy_starts_as_the_embedding(position: str) -> None:
    """The last stage's copy is drawn as layer 0 draws the embedding (learned positions first)."""
    spec = dataclasses.replace(tied_tiny(), position=position)
    whole = Decoder(spec, seed=5)
    last = Decoder(spec, first_layer=spec.num_layers - 2, seed=5)
    assert last.head.out is not None and whole.head.out is None
    assert torch.equal(last.head.out.weight, whole.embed.tok.weight)
    assert shared_name(spec, "head.out.weight") == "embed.tok.weight"


TP_PLANS = {
    "pp2-tp2,1": dict(tp=(2, 1), dp=1, split="3,3", zero="0,0", schedule="1f1b", micro_batches="4"),
    # The row path (tied_sum_by_rows) on sharded ends, a TP group at one end, two replicas.
    "pp2-tp1,2-dp2-zero3,1": dict(tp=(1, 2), dp=2, split="3,3", zero="3,1", schedule="1f1b",
                                  micro_batches="3,2"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(TP_PLANS))
def test_tied_pipeline_with_tensor_parallel_stages(name: str, tmp_path: Path) -> None:
    """The tied ends stay whole on every TP rank (embedding and head are not split): each TP
    rank's copy takes the same summed gradient, and training equals the one-process reference."""
    check_tied_run(tp_plan(model=tied_tiny(), **TP_PLANS[name]), tmp_path)
