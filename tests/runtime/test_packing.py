"""Packed instruction data (``--pack``): each example keeps the losses it has alone (1e-5, RoPE,
learned positions and a sliding window), packed sequences are a pure function of the seed and
the step (a resume packs as the run did), and a packed pp2 x dp2 run and a tp 2 run give the
single-process reference's losses (which pack the same way), with sequence parallelism too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from chat_sets import chatml_tokenizer, write_chats, write_pairs
from hypothesis import given, settings
from hypothesis import strategies as st
from train_plans import SEED, config, tiny_plan, tp_plan

from medley.data.examples import IGNORE, Examples
from medley.data.packing import Packer
from medley.errors import MedleyInputError
from medley.launch.spawn import train_local
from medley.runtime.reference import reference_run
from medley.runtime.train import load_data
from medley.runtime.transformer import Decoder, token_loss_sum
from medley.spec.model_arg import get_model

TOL = 1e-5
SEQ = 64


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def _examples(lengths: list[int], *, seq_len: int) -> Examples:
    """Examples of the given lengths, ids 1.. in order, every token after the first learned."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids = torch.arange(1, offsets[-1] + 1).numpy() % 250 + 1
    mask = torch.ones(offsets[-1], dtype=torch.uint8).numpy()
    return Examples(ids=ids, mask=mask, offsets=torch.tensor(offsets).numpy(),
                    order=torch.arange(len(lengths)).numpy(), seq_len=seq_len, pad_id=0)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(2, 40), min_size=2, max_size=30), seed=st.integers(0, 5),
       first=st.integers(0, 20))
def test_packed_rows_hold_whole_examples_in_sample_order(lengths: list[int], seed: int, first: int) -> None:
    seq_len = 24
    packer = Packer(examples=_examples(lengths, seq_len=seq_len))
    rows = packer.rows(seed, first, 4)
    starts = packer.starts(seed, first + 4)
    fresh = Packer(examples=packer.examples).rows(seed, first, 4)  # a resumed run, packed from scratch
    assert torch.equal(rows.tokens, fresh.tokens) and torch.equal(rows.segments, fresh.segments)
    for r in range(4):
        samples = packer.samples(seed, starts[first + r], starts[first + r + 1] - starts[first + r])
        assert samples, "every sequence holds an example"
        at = 0
        for segment, index in enumerate(samples):
            n = lengths[index]
            w = min(n - 1, seq_len)
            lo = int(packer.examples.offsets[index])
            ids = torch.from_numpy(packer.examples.ids[lo:lo + w + 1].astype("int64"))
            assert torch.equal(rows.tokens[r, at:at + w], ids[:w])
            assert torch.equal(rows.targets[r, at:at + w], ids[1:])
            assert bool((rows.segments[r, at:at + w] == segment).all())
            at += w
        assert bool((rows.targets[r, at:] == IGNORE).all())
        assert bool((rows.segments[r, at:] == len(samples)).all())
        nxt = packer.samples(seed, starts[first + r + 1], 1)[0]
        assert at + min(lengths[nxt] - 1, seq_len) > seq_len, "next-fit: the next example did not fit"


@pytest.mark.parametrize("variant", ["rope", "learned", "window"])
def test_a_packed_example_has_the_losses_it_has_alone(variant: str) -> None:
    spec = get_model("tiny")
    if variant == "learned":
        spec = dataclasses.replace(spec, position="learned")
    elif variant == "window":
        spec = dataclasses.replace(spec, sliding_window=8)
    model = Decoder(spec, seed=SEED)
    lengths = [9, 17, 5, 30, 12, 3]
    examples = _examples(lengths, seq_len=SEQ)
    packed = Packer(examples=examples, shuffled=False).rows(0, 0, 2)
    assert int(packed.segments[0, -1]) >= 3, "several examples share the first sequence"
    with torch.no_grad():
        logits = model(packed.tokens[:, :-1], packed.segments)
        alone_tokens, alone_targets = examples.rows(list(range(len(lengths))))
        alone = model(alone_tokens[:, :-1])
    lo = 0
    for row in range(2):
        for segment in range(int(packed.segments[row].max())):
            at = (packed.segments[row] == segment).nonzero().flatten()
            if not len(at):
                continue
            got = token_loss_sum(logits[row, at], packed.targets[row, at])
            want = token_loss_sum(alone[lo % len(lengths)], alone_targets[lo % len(lengths)])
            assert abs(float(got) - float(want)) <= TOL * max(1.0, abs(float(want)))
            lo += 1
    assert lo > len(lengths), "the second sequence wraps around to the first examples"


def test_pack_reports_its_efficiency_and_refuses_text(chatml: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 40)
    cfg = config(data=str(data), tokenizer=str(chatml), data_cache=tmp_path / "cache", pack=True)
    source = load_data(cfg, seq_len=SEQ * 2, vocab_size=get_model("tiny").vocab_size)
    note = next(n for n in source.notes if n.startswith("--pack"))
    assert "packed 40 examples into" in note and "padding" in note
    plain = load_data(config(data=str(data), tokenizer=str(chatml), data_cache=tmp_path / "cache"),
                      seq_len=SEQ * 2, vocab_size=get_model("tiny").vocab_size)
    assert plain.fingerprint != source.fingerprint, "a resume that changes --pack is a changed data order"
    assert any("of the positions are padding; --pack would fill" in n for n in plain.notes)
    with pytest.raises(MedleyInputError, match="--pack: .* is text"):
        load_data(config(data="synthetic", pack=True), seq_len=SEQ, vocab_size=256)


@pytest.mark.timeout(300)
def test_packed_conversations_on_pp2_dp2_match_the_reference(chatml: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 40)
    settings_ = dict(data=str(data), tokenizer=str(chatml), data_cache=tmp_path / "cache", val_fraction=0.2,
                     eval_every=2, eval_batches=1, steps=3, pack=True)
    plan = tiny_plan(pp=2, dp=2, split="3,3", zero="3,1", schedule="1f1b", micro_batches="3,2",
                     seq_len=SEQ * 2)
    records = train_local(plan, config(**settings_))
    want = reference_run(plan.layout, config(**settings_))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    got = {r.step: r.eval_loss for r in records if r.eval_loss is not None}
    assert sorted(got) == sorted(want.eval_losses)
    assert max(abs(got[s] - want.eval_losses[s]) for s in got) <= TOL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_packed_pairs_under_tp2_with_recompute_match_the_reference(chatml: Path, tmp_path: Path,
                                                                   sequence_parallel: bool) -> None:
    data = write_pairs(tmp_path / "pairs.jsonl", 30)
    settings_ = dict(data=str(data), tokenizer=str(chatml), data_cache=tmp_path / "cache", steps=3, pack=True)
    plan = tp_plan(tp=(2,), split="6", zero="1", schedule="1f1b", micro_batches="2", seq_len=SEQ,
                   recompute=True, sequence_parallel=sequence_parallel)
    records = train_local(plan, config(**settings_))
    want = reference_run(plan.layout, config(**settings_))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
