"""``--epochs E`` sets the steps from the data: E passes over the training examples (packed
sequences when packed, windows for token data), rounded up to whole steps; data without epochs
(byte text at random offsets) and a bad E are one line; a launched run takes the
steps and matches the reference, which counts them the same way."""

from __future__ import annotations

import math

import pytest
from chat_sets import chatml_tokenizer, write_chats
from train_plans import config, tiny_plan

from medley.data.packing import Packer
from medley.errors import MedleyInputError
from medley.launch.spawn import train_local
from medley.runtime.config import check_config, with_epochs
from medley.runtime.reference import reference_run
from medley.runtime.train import load_data

SEQ = 64
SEQUENCES = 8


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("epochs")
    return dict(data=str(write_chats(root / "chat.jsonl", 30)), tokenizer=str(chatml_tokenizer(root / "tok")),
                data_cache=root / "cache")


@pytest.mark.parametrize("pack", [False, True])
def test_epochs_count_examples_or_packed_sequences(chats: dict, pack: bool) -> None:
    cfg = config(**chats, epochs=2.5, pack=pack)
    source = load_data(cfg, seq_len=SEQ, vocab_size=256)
    examples = source.examples
    per_epoch = Packer(examples=examples).stats(cfg.data.seed).sequences if pack else examples.count
    assert pack or per_epoch == 30
    cfg, note = with_epochs(cfg, source, sequences=SEQUENCES)
    assert cfg.optimizer.steps == math.ceil(2.5 * per_epoch / SEQUENCES)
    assert note == (f"--epochs 2.5: {cfg.optimizer.steps} steps of {SEQUENCES} sequences over {per_epoch} "
                    f"{'packed sequences' if pack else 'examples'} per epoch")


def test_random_offsets_have_no_epochs_and_a_bad_count_is_refused() -> None:
    cfg = config(epochs=1)
    with pytest.raises(MedleyInputError, match="--epochs: shipped:corpus.txt is sampled at random offsets"):
        with_epochs(cfg, load_data(cfg, seq_len=SEQ, vocab_size=256), sequences=SEQUENCES)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(MedleyInputError, match="--epochs .*: must be a number > 0"):
            check_config(config(epochs=bad))


@pytest.mark.timeout(300)
def test_a_launched_run_of_two_epochs_takes_their_steps(chats: dict) -> None:
    plan = tiny_plan(pp=2, dp=1, split="3,3", zero="1,1", schedule="1f1b", micro_batches="2", seq_len=SEQ)
    sequences = sum(plan.layout.micro_batches) * plan.layout.micro_batch_size
    cfg = config(**chats, epochs=0.5, warmup_steps=1)
    records = train_local(plan, cfg)
    assert len(records) == math.ceil(0.5 * 30 / sequences)
    assert cfg.optimizer.steps == 6, "the caller's config is left as given"
    want = reference_run(plan.layout, cfg)
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= 1e-5
