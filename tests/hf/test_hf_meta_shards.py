"""``--init-from`` into meta-built stages under TP and ZeRO-3 together: each rank reads only its
box of every tensor (a TP slice, then FSDP2's dim-0 rows of it; the odd vocabulary of 257 rows
leaves the embedding and the head uneven shards of 129 and 128 rows), and training equals the
single-process reference from the same weights (fp32, 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_models import MICRO_BATCH_SIZE, SEQ_LEN

from medley.cost.estimator import CatalogCostSource
from medley.launch.spawn import train_local
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan
from medley.runtime.reference import reference_losses
from medley.runtime.train import TrainConfig
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

TOL = 1e-5


def tp_hf_plan(directory: Path, *, pp: int, dp: int, tp: str, split: str, zero: str) -> Plan:
    degrees = [int(d) for d in tp.split(",")]
    cluster = parse_cluster_arg(f"{dp * sum(degrees)}xA100-80GB")
    model = get_model(str(directory))
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=pp, dp=dp,
        schedule="1f1b", micro_batches=",".join(["2"] * dp), micro_batch_size=MICRO_BATCH_SIZE,
        seq_len=SEQ_LEN, split=split, zero=zero, dtype="fp32", tp=tp)
    return Plan(layout=layout, cluster=cluster)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "pp", "tp", "split", "zero"), [
    ("llama", 1, "2", "4", "3"),  # dp2 x tp2, ZeRO-3: 2-D shards (FSDP2 rows of TP slices)
    ("qwen2", 2, "2,2", "2,2", "3,0"),  # tied embedding, its head copy on a tp2 ZeRO-0 stage
])
def test_tp_zero3_stages_read_their_boxes_of_hf_weights(hf_models, family: str, pp: int, tp: str, split: str,
                                                        zero: str) -> None:
    directory = hf_models[family]
    plan = tp_hf_plan(directory, pp=pp, dp=2, tp=tp, split=split, zero=zero)
    config = TrainConfig.of(steps=2, seed=3, lr=1e-2, progress=False, measure_memory=False,
                            init_from=directory)
    records = train_local(plan, config)
    want = reference_losses(plan.layout, config)
    assert max(abs(r.loss - w) for r, w in zip(records, want, strict=True)) <= TOL
    seeded = reference_losses(plan.layout, TrainConfig.of(steps=1, seed=3, progress=False))
    assert abs(records[0].loss - seeded[0]) > 1e-3, "the run must start from the directory's weights"
