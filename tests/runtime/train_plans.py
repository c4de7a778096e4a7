"""Plans and callbacks shared by the training tests (importable by the launched ranks)."""

from __future__ import annotations

import os

from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.runtime.train import TrainConfig
from medley.spec.cluster import parse_cluster_arg
from medley.spec.model import get_model

SEQ_LEN, MICRO_BATCH_SIZE, SEED = 32, 2, 3


def tiny_plan(*, pp: int, dp: int, split: str, zero: str, schedule: str, micro_batches: str,
              buckets: int = 1, **inline: object) -> Plan:
    cluster = parse_cluster_arg(f"{pp * dp}xA100-80GB")
    model = get_model("tiny")
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=pp, dp=dp,
        schedule=schedule, micro_batches=micro_batches, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN,
        split=split, zero=zero, buckets=buckets, **inline)
    return Plan(layout=layout, cluster=cluster)


def config(**overrides: object) -> TrainConfig:
    """Six AdamW steps, two of warm-up, clipping active (gradient norms here are about 3-4)."""
    base = dict(steps=6, seed=SEED, warmup_steps=2, lr=3e-3, min_lr=3e-4, clip_norm=1.0, checkpoint_every=2,
                progress=False)
    return TrainConfig(**{**base, **overrides})


def crash_rank_one_once(step: int) -> None:
    """Kill rank 1 after step 4 on the first attempt only (torchelastic counts restarts)."""
    if step == 4 and os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os._exit(3)


class StopTraining(Exception):
    """Raised by :func:`stop_after_step_3` to end a run early, as a job's time limit would."""


def stop_after_step_3(step: int) -> None:
    if step == 3:
        raise StopTraining(f"stopped after step {step}")
