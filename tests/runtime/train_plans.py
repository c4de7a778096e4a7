"""Plans and callbacks shared by the training tests (importable by the launched ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.layout import check_tp
from medley.plan.plan import Plan
from medley.runtime.groups import row_major_table
from medley.runtime.train import TrainConfig
from medley.runtime.transformer import TIED_WEIGHT
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

SEQ_LEN, MICRO_BATCH_SIZE, SEED = 32, 2, 3


def tiny_plan(*, pp: int, dp: int, split: str, zero: str, schedule: str, micro_batches: str,
              buckets: int = 1, model: ModelSpec | None = None, devices: int | None = None,
              seq_len: int = SEQ_LEN, **inline: object) -> Plan:
    cluster = parse_cluster_arg(f"{devices or pp * dp}xA100-80GB")
    model = model or get_model("tiny")
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=pp, dp=dp,
        schedule=schedule, micro_batches=micro_batches, micro_batch_size=MICRO_BATCH_SIZE, seq_len=seq_len,
        split=split, zero=zero, buckets=buckets, **inline)
    return Plan(layout=layout, cluster=cluster)


def tp_plan(*, tp: tuple[int, ...], dp: int = 1, **plan: object) -> Plan:
    """:func:`tiny_plan` with TP degree ``tp[k]`` on pipeline rank k, on ``dp * sum(tp)`` devices of
    one node: replica r's pipeline rank k on the consecutive devices after those of rank k - 1."""
    base = tiny_plan(pp=len(tp), dp=dp, devices=dp * sum(tp), **plan)
    table = row_major_table(len(tp), dp, tp)  # device ids in the order the plan's devices go
    layout = dataclasses.replace(base.layout, tp=tuple(tp),
                                 assignment=tuple(tuple(group[0] for group in row) for row in table))
    check_tp(layout, base.cluster)
    return Plan(layout=layout, cluster=base.cluster)


def config(**overrides: object) -> TrainConfig:
    """Six AdamW steps, two of warm-up, clipping active (gradient norms here are about 3-4)."""
    base = dict(steps=6, seed=SEED, warmup_steps=2, lr=3e-3, min_lr=3e-4, clip_norm=1.0, checkpoint_every=2,
                progress=False)
    return TrainConfig.of(**{**base, **overrides})


def crash_rank_one_once(step: int) -> None:
    """Kill rank 1 after step 4 on the first attempt only (torchelastic counts restarts)."""
    if step == 4 and os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os._exit(3)


class StopTraining(Exception):
    """Raised by :func:`stop_after_step_3` to end a run early, as a job's time limit would."""


def stop_after_step_3(step: int) -> None:
    if step == 3:
        raise StopTraining(f"stopped after step {step}")


def tied_tiny() -> ModelSpec:
    """The tiny model with its LM head tied to the token embedding (as small Qwen2 / Llama-3.2)."""
    return dataclasses.replace(get_model("tiny"), name="tiny-tied", tied_embeddings=True)


def save_tied_copies(directory: str, step: int, stages: dict, scale: float | None) -> None:
    """grad_hook: every copy of the tied weight this rank holds (full tensor) with its gradient at
    the CLIP action, saved as ``<directory>/step<step>-rank<rank>-stage<stage>.pt``."""
    for index, stage in stages.items():
        params = dict(stage.named_parameters_local())
        if TIED_WEIGHT not in params:
            continue
        param = params[TIED_WEIGHT]
        grad = stage.final_grad(param)
        full = {"param": param.full_tensor() if hasattr(param, "full_tensor") else param.detach(),
                "grad": grad.full_tensor() if hasattr(grad, "full_tensor") else grad}
        rank = torch.distributed.get_rank()
        torch.save({k: v.detach().clone() for k, v in full.items()},
                   Path(directory) / f"step{step}-rank{rank}-stage{index}.pt")


def asymmetric_plan(*groups: dict[str, object]) -> Plan:
    """A plan of replica groups of their own shape (:mod:`medley.plan.segments`) on
    ``sum(devices)`` devices of one node: each group a :func:`tiny_plan` (``pp``, ``dp``,
    ``split``, ``zero``, ``schedule``, ``micro_batches``, ...) on the devices after the previous
    group's, in :func:`tiny_plan`'s order."""
    total = sum(int(g["pp"]) * int(g["dp"]) for g in groups)  # type: ignore[call-overload]
    cluster = parse_cluster_arg(f"{total}xA100-80GB")
    layouts, first = [], 0
    for spec in groups:
        base = tiny_plan(devices=total, **spec)  # type: ignore[arg-type]
        layout = base.layout
        order = sorted(layout.devices)
        moved = {d: first + order.index(d) for d in order}
        layouts.append(dataclasses.replace(
            layout, assignment=tuple(tuple(moved[d] for d in row) for row in layout.assignment)))
        first += len(order)
    return Plan(groups=layouts, cluster=cluster)


def reference_layout(plan: Plan):  # noqa: ANN201 - a PlanLayout: what the reference needs of a plan
    """One layout with the plan's whole global batch (model, sequence length, micro-batches), for
    :mod:`medley.runtime.reference`."""
    replicas = len(plan.micro_batches)
    return dataclasses.replace(plan.shared, dp=replicas, micro_batches=plan.micro_batches, sync_dp=0,
                               assignment=tuple((r,) * plan.shared.pp for r in range(replicas)))


def save_shards(directory: str, step: int, stages: dict, scale: float | None) -> None:
    """grad_hook: at step 0, this rank's parameters as it built them (:func:`medley.dryrun.ranks.
    shards`: name, global and local shape, dtype, placements) as ``<directory>/rank<rank>.json``."""
    from medley.dryrun.ranks import shards

    if step == 0:
        found = [dataclasses.asdict(shard) for shard in shards(stages)]
        Path(directory, f"rank{os.environ['RANK']}.json").write_text(json.dumps(found))
