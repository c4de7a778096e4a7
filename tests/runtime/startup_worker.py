"""Rank body of the start-up memory test: the peak of live tensor bytes while this rank builds its
stages (torch dispatch sees every allocation, :class:`medley.runtime.memory.LiveTensorBytes`),
beside the bytes of the shards it keeps and of the model's largest layer, whole, and how far its
parameters are from the single-process model's seeded ones."""

from __future__ import annotations

import dataclasses

import torch
from equality_worker import Case

from medley.runtime.groups import make_groups, row_major_table
from medley.runtime.memory import LiveTensorBytes
from medley.runtime.stages import build_local_stages
from medley.runtime.transformer import Decoder
from medley.schedule.ir import with_default_collectives
from medley.spec.model_arg import get_model

# Many small blocks: a whole stage is several times one layer, so building it whole is unambiguous.
SPEC = dataclasses.replace(get_model("tiny"), name="startup", vocab_size=1024, hidden_size=256, num_blocks=8,
                           num_heads=4, num_kv_heads=4, ffn_hidden_size=704)


class StoredBytes(LiveTensorBytes):
    """Live bytes of tensors with storage (meta tensors have a size but hold nothing)."""

    def _track(self, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.is_meta:
            super()._track(tensor)


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def startup_case(case: Case) -> dict:
    groups = make_groups(case.table or row_major_table(case.pp, case.dp, case.tp))
    schedule = with_default_collectives(case.schedules[groups.place.replica])
    mode = StoredBytes([])
    with mode:
        stages = build_local_stages(SPEC, schedule=schedule, split=case.split, zero=case.zero, groups=groups,
                                    seed=3, optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1))
    shards = sum(_bytes(p) for stage in stages.values() for bucket in stage.buckets for p in bucket)
    with torch.device("meta"):
        whole = Decoder(SPEC, init=False)
    layers = [sum(p.numel() * 4 for p in layer.parameters()) for layer in whole.layer_modules().values()]
    reference = dict(Decoder(SPEC, seed=3).named_parameters())
    init_diff = max((p - reference[name]).abs().max().item()
                    for stage in stages.values() for name, p in stage.named_params().items())
    whole_stages = sum(p.numel() * 4 for stage in stages.values() for bucket in stage.buckets for p in bucket)
    return {"peak": float(mode.peak), "shards": float(shards), "largest_layer": float(max(layers)),
            "stages": float(whole_stages), "init_diff": init_diff}
