"""Pieces of the training runtime that need no launch: data, schedule, checkpoint safety and
errors, plan checks and the bad input of `medley train` (a one-rank group runs in-process)."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_plans import config, tiny_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.data.load import load_source
from medley.data.source import Rows, decode, encode, replica_slice
from medley.errors import MedleyInputError
from medley.plan.plan import Plan
from medley.runtime.checkpoint_layout import META_FILE, checkpoint_path
from medley.runtime.checkpoint_verify import SafeReader
from medley.runtime.optim import lr_at
from medley.runtime.reference import reference_losses
from medley.runtime.setup import check_plan
from medley.runtime.sharding import ShardedStage
from medley.runtime.train import train
from medley.runtime.transformer import Decoder
from medley.spec.model_arg import get_model


def test_byte_tokenizer_round_trips() -> None:
    text = "Bread is flour, water, salt and time. Crème brûlée."
    assert decode(encode(text)) == text
    assert int(encode(text).max()) < 256


@pytest.mark.parametrize("data", [None, "synthetic"])
def test_global_batch_is_a_function_of_the_step_and_replicas_split_it(data: str | None) -> None:
    source = load_source(data, seq_len=16)
    first = source.global_batch(step=4, seed=1, sequences=8, seq_len=16)
    assert torch.equal(first, source.global_batch(step=4, seed=1, sequences=8, seq_len=16))
    assert not torch.equal(first, source.global_batch(step=5, seed=1, sequences=8, seq_len=16))
    rows = []
    for replica in range(2):
        part = replica_slice(Rows.of(first), micro_batches=(3, 1), micro_batch_size=2, replica=replica)
        assert part.loss_tokens == 8 * 16
        assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in zip(part.inputs, part.targets, strict=True))
        rows += [torch.cat([x, y[:, -1:]], dim=1) for x, y in zip(part.inputs, part.targets, strict=True)]
    assert torch.equal(torch.cat(rows), first)


def test_bad_data_files_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(MedleyInputError, match="--data"):
        load_source(tmp_path / "missing.txt", seq_len=16)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(MedleyInputError, match="--seq-len"):
        load_source(short, seq_len=16)


def test_learning_rate_warms_up_then_decays_to_the_minimum() -> None:
    lrs = [lr_at(s, lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=20) for s in range(21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[20] == pytest.approx(0.1)


def test_a_zero_learning_rate_stays_zero_whatever_the_minimum() -> None:
    # min_lr is capped at lr: --lr 0 updates nothing (the export round trip relies on it)
    assert [lr_at(s, lr=0.0, min_lr=3e-4, warmup_steps=2, total_steps=6) for s in range(7)] == [0.0] * 7


class _Exploit:
    def __reduce__(self):  # noqa: ANN204
        return (os.system, ("echo pwned",))


def test_checkpoint_metadata_never_unpickles_code(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        SafeReader(tmp_path).read_metadata()


def test_plan_checks_name_the_setting() -> None:
    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="0", schedule="1f1b", micro_batches="2")
    with pytest.raises(MedleyInputError, match="--local-ranks 2"):
        check_plan(plan, 3)


def test_zero3_compute_without_unshard_is_an_error() -> None:
    module = Decoder(get_model("tiny"), first_layer=0, last_layer=2)
    params = list(module.parameters())
    stage = ShardedStage(module=module, zero=3, buckets=[params], fsdp_units=[], dp_groups=[None],
                         optimizers=[], bucket_names=[[str(i) for i in range(len(params))]])
    with pytest.raises(RuntimeError, match="UNSHARD.*layout.zero"):
        stage.require_gathered("0F0 on pipeline rank 0")


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_one_rank_run_and_checkpoint_errors(one_rank_group, tmp_path: Path) -> None:
    plan = tiny_plan(pp=1, dp=1, split="6", zero="0", schedule="1f1b", micro_batches="2")
    directory = tmp_path / "ckpt"
    records = train(plan, config(steps=2, checkpoint_dir=directory, measure_memory=False))
    want = reference_losses(plan.layout, config(steps=2))
    assert [r.loss for r in records] == pytest.approx(want, abs=1e-6)
    assert train(plan, config(steps=2, checkpoint_dir=directory)) == []  # already done
    other_seq = Plan(layout=dataclasses.replace(plan.layout, seq_len=16), cluster=plan.cluster)
    with pytest.raises(MedleyInputError, match="seq_len.*--seq-len"):
        train(other_seq, config(steps=3, checkpoint_dir=directory))
    with pytest.raises(MedleyInputError, match="cosine over 2 steps.*cosine over 3 steps.*--extend-schedule"):
        train(plan, config(steps=3, checkpoint_dir=directory))
    longer = config(steps=3, checkpoint_dir=directory, extend_schedule=True)
    data_file = next(checkpoint_path(directory, 2).glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(MedleyInputError, match=f"{data_file.name}: its content changed.*sha256"):
        train(plan, longer)
    (checkpoint_path(directory, 2) / META_FILE).write_text("{not json")
    with pytest.raises(MedleyInputError, match="medley.json"):
        train(plan, longer)


@pytest.mark.timeout(120)
def test_one_rank_bf16_and_emulated_slowdown(one_rank_group) -> None:
    plan = tiny_plan(pp=1, dp=1, split="6", zero="2", schedule="1f1b", micro_batches="2")
    want = reference_losses(plan.layout, config(steps=2))
    bf16 = train(plan, config(steps=2, dtype="bf16", measure_memory=False))
    assert [r.loss for r in bf16] == pytest.approx(want, abs=1e-2)
    slowed = train(plan, config(steps=2, slowdown={0: 3.0}, measure_memory=False))
    assert [r.loss for r in slowed] == pytest.approx(want, abs=1e-6)
    # The rank sleeps twice the time of each compute action; optimizer steps are not stretched
    # (and a loaded machine may preempt anything), so only demand a clear share of the steps.
    assert all(r.emulated_sleep_s > 0 for r in slowed)
    assert sum(r.emulated_sleep_s for r in slowed) > 0.3 * sum(r.step_time_s for r in slowed)


def test_default_slowdown_follows_peak_flops() -> None:
    from medley.runtime.emulated_devices import slowdown_factors
    from medley.spec.cluster_load import parse_cluster_arg

    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="0", schedule="1f1b", micro_batches="2")
    mixed = Plan(layout=plan.layout, cluster=parse_cluster_arg("1xA100-80GB+1xT4-16GB"))
    factors = slowdown_factors(mixed)
    a100, t4 = (mixed.cluster.devices[d].type for d in (0, 1))
    assert factors == {0: 1.0, 1: pytest.approx(a100.peak_flops("bf16") / t4.peak_flops("bf16"))}
    assert slowdown_factors(mixed, {0: 2.0})[0] == 2.0
    with pytest.raises(MedleyInputError, match="--slowdown"):
        slowdown_factors(mixed, {7: 2.0})


@pytest.mark.parametrize(("args", "message"), [
    (["--pp", "2", "--dp", "2", "--split", "2,2", "--local-ranks", "3"], "--local-ranks 4"),
    (["--pp", "2", "--split", "2,2"], "torchrun --nproc-per-node 2"),
    (["--plan", "no-such-plan.toml"], "no-such-plan.toml"),
    (["--slowdown", "fast"], "--slowdown"),
    (["--steps", "0"], "--steps"),
    (["--pp", "2", "--split", "2,2,2"], "--split"),
])
def test_train_command_rejects_bad_input(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
