"""Training on instruction data, launched (gloo, CPU): conversations in the tokenizer's chat
template and prompt/completion pairs, on pp2 x dp2 plans, give the single-process reference's
losses and validation losses (1e-5), and the first loss is the mean cross-entropy over the
learned (assistant, completion) tokens of the global batch alone, computed here directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from chat_sets import chatml_tokenizer, write_chats, write_pairs
from train_plans import SEED, config, tiny_plan

from medley.data.examples import IGNORE
from medley.launch.spawn import train_local
from medley.runtime.reference import reference_run
from medley.runtime.train import load_data
from medley.runtime.transformer import Decoder

TOL = 1e-5
SEQ = 128
PLAN = dict(pp=2, dp=2, split="3,3", zero="3,1", schedule="1f1b", micro_batches="3,2", seq_len=SEQ)
PLAN_ZB = dict(pp=2, dp=2, split="2,4", zero="1,3", schedule="zb-h1", micro_batches="2,3", buckets=2,
               seq_len=SEQ)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def _masked_mean_first_loss(settings: dict, plan: object) -> float:
    """The step-0 loss from its definition: the seeded model's mean cross-entropy over the
    global batch's learned targets (ignored ones skipped, as transformers' labels -100)."""
    layout = plan.layout
    source = load_data(config(**settings), seq_len=SEQ, vocab_size=layout.model.vocab_size)
    sequences = sum(layout.micro_batches) * layout.micro_batch_size
    rows = source.global_rows(step=0, seed=SEED, sequences=sequences, seq_len=SEQ)
    assert (rows.targets == IGNORE).any() and (rows.targets != IGNORE).any()
    with torch.no_grad():
        logits = Decoder(layout.model, seed=SEED)(rows.tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows.targets.reshape(-1),
                           ignore_index=IGNORE).item()


@pytest.mark.timeout(300)
def test_conversations_on_pp2_dp2_match_the_reference(chatml: Path, tmp_path: Path) -> None:
    data = write_chats(tmp_path / "chat.jsonl", 30)
    settings = dict(data=str(data), tokenizer=str(chatml), data_cache=tmp_path / "cache", val_fraction=0.2,
                    eval_every=2, eval_batches=1, steps=4)
    plan = tiny_plan(**PLAN)
    records = train_local(plan, config(**settings))
    want = reference_run(plan.layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    got = {r.step: r.eval_loss for r in records if r.eval_loss is not None}
    assert sorted(got) == sorted(want.eval_losses) == [1, 3]
    assert max(abs(got[s] - want.eval_losses[s]) for s in got) <= TOL
    assert abs(records[0].loss - _masked_mean_first_loss(settings, plan)) <= TOL
    assert records[-1].loss < records[0].loss


@pytest.mark.timeout(300)
def test_prompt_completion_pairs_on_pp2_dp2_match_the_reference(chatml: Path, tmp_path: Path) -> None:
    data = write_pairs(tmp_path / "pairs.jsonl", 24)
    settings = dict(data=str(data), tokenizer=str(chatml), data_cache=tmp_path / "cache", steps=3)
    plan = tiny_plan(**PLAN_ZB)
    records = train_local(plan, config(**settings))
    want = reference_run(plan.layout, config(**settings))
    assert max(abs(r.loss - w) for r, w in zip(records, want.losses, strict=True)) <= TOL
    assert abs(records[0].loss - _masked_mean_first_loss(settings, plan)) <= TOL
