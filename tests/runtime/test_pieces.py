"""Single-process checks of the runtime's building blocks."""

from __future__ import annotations

import pytest
import torch

from medley.runtime.sharding import bucket_layer_groups
from medley.runtime.stages import layer_ranges
from medley.runtime.transformer import Decoder
from medley.schedule.generators import generate
from medley.schedule.ir import Kind, with_default_collectives
from medley.spec.model_arg import get_model


def test_stages_chain_to_the_full_model() -> None:
    spec = get_model("tiny")
    tokens = torch.randint(0, spec.vocab_size, (2, 8))
    full = Decoder(spec, seed=3)
    x = tokens
    for first, last in layer_ranges((1, 3, 2), spec.num_layers):
        x = Decoder(spec, first_layer=first, last_layer=last, seed=3)(x)
    assert torch.equal(x, full(tokens))


def test_layer_ranges_reject_a_wrong_split() -> None:
    with pytest.raises(ValueError, match="covers 5 layers"):
        layer_ranges((2, 3), 6)


def test_buckets_cut_consecutive_layers() -> None:
    assert bucket_layer_groups([3, 4, 5], (1, 2)) == [[3], [4, 5]]
    assert bucket_layer_groups([3, 4, 5], None) == [[3, 4, 5]]
    with pytest.raises(ValueError):
        bucket_layer_groups([3, 4, 5], (2, 2))


def test_default_collectives_follow_the_last_backward() -> None:
    schedule = with_default_collectives(generate("1f1b", pp=2, micro_batches=3))
    row = [str(a) for a in schedule.actions[1]]
    assert row[0] == "1UNSHARD" and row[-2:] == ["1RESHARD", "1OPTIM"]
    last_bw = max(i for i, a in enumerate(schedule.actions[1]) if a.kind is Kind.BW)
    assert row.index("1REDUCE_GRAD") > last_bw
    assert any(a.kind is Kind.SEND_F for a in schedule.actions[0])
