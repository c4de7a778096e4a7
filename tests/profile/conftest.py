"""Shared pieces of the profile tests: a hand-made profile of the tiny model."""

from __future__ import annotations

import pytest

from medley.cost.profile_format import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    AlphaBeta,
    CommMeasurement,
    CommProfile,
    LayerMeasurement,
    OptimizerProfile,
    Profile,
    model_dict,
)
from medley.spec.model_arg import get_model


def layer(kind: str, mbs: int, seq: int, scale: float = 1.0) -> LayerMeasurement:
    """Times proportional to tokens (x ``scale``): F = t, B = 2t, W = t, fused = 2.5t, in µs."""
    t = mbs * seq * 1e-6 * scale
    return LayerMeasurement(kind=kind, micro_batch_size=mbs, seq_len=seq, forward_s=t, backward_input_s=2 * t,
                            backward_weight_s=t, backward_full_s=2.5 * t, activation_bytes=1000.0 * mbs * seq,
                            activation_after_b_bytes=400.0 * mbs * seq, runs=3)


def make_profile() -> Profile:
    layers = [layer(kind, mbs, seq, scale={"embedding": 0.1, "block": 1.0, "head": 0.5}[kind])
              for seq in (64, 128) for mbs in (1, 4) for kind in ("embedding", "block", "head")]
    fit = AlphaBeta(latency_s=1e-4, bandwidth_bytes_per_s=1e9, median_rel_error=0.0)
    comm = CommProfile(backend="gloo", fits={"all_reduce": fit}, link=fit, link_by_ranks={"2": fit},
                       measurements=[CommMeasurement(op="all_reduce", ranks=2, nbytes=4096.0, seconds=2e-4)])
    return Profile(format=PROFILE_FORMAT, version=PROFILE_VERSION, created="2026-01-01T00:00:00+00:00",
                   host="test", device_type="CPU-8GB", device_kind="cpu", device_detail="test cpu",
                   torch_version="2.13.0", dtype="fp32", threads=1, model=model_dict(get_model("tiny")),
                   layers=layers, comm=comm,
                   optimizer=OptimizerProfile(name="AdamW", fixed_s=1e-5, per_param_s=1e-8))


@pytest.fixture
def profile() -> Profile:
    return make_profile()
