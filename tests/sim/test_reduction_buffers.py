"""A bucket's gradient-reduction buffers are booked once per step, however often it reduces."""

from __future__ import annotations

import dataclasses

import pytest

from medley.cost.estimator import CatalogCostSource
from medley.lowering.predict import predict
from medley.plan.inline import inline_layout
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model


@pytest.mark.parametrize("level", [2, 3])
def test_peak_does_not_grow_with_reductions_per_step(level: int) -> None:
    """pp 1 holds one micro-batch's activations at a time, so its peak is the same for 3 and 8
    micro-batches; streamed ZeRO-3 reduces after every compute action (6 vs 16 reductions per
    bucket) and ZeRO-2 with gradient windows once per window. (From the second window on, the
    next forward overlaps reductions with every gradient shard already made, the first window
    with only some of them: 2 micro-batches, one such window less, hold less.)"""
    cluster, model = parse_cluster_arg("2xA100-80GB"), get_model("tiny")
    peaks = []
    for micro_batches in (3, 8):
        layout = inline_layout(
            cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=1, dp=2,
            schedule="1f1b", micro_batches=str(micro_batches), micro_batch_size=1, seq_len=64,
            zero=str(level), buckets=3, gather_windows=0 if level == 3 else 1, dtype="fp32",
        )
        if level == 2:
            layout = dataclasses.replace(
                layout, zero=tuple(dataclasses.replace(z, grad_windows=micro_batches) for z in layout.zero))
        peaks.append(predict(layout, cluster)[0].peak_memory_gb[0])
    assert peaks[0] == pytest.approx(peaks[1], rel=1e-12)
