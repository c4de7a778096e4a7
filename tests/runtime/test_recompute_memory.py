"""What each recomputation mode keeps between a stage's forward and its backward, measured on CPU
(live tensor storages, as the runtime's memory probe counts them) against what the compiler books
for the simulator (:class:`medley.sim.problem.StageCost` activation bytes, from the measured
profile of the tiny model and the formulas of :mod:`medley.cost.recompute`): within 5% on each
rank of a two-stage pipeline, for full, selective and first-k-blocks recomputation; and the
selective policy's saved tensors are exactly the formulas' count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from medley.cost import formulas
from medley.cost.profile_format import load_profile
from medley.cost.profiles import ProfileCostSource
from medley.cost.recompute import Recompute, parse_recompute
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.runtime.memory import LiveTensorBytes
from medley.runtime.transformer import Decoder, token_loss_sum
from medley.spec.catalog import CPU_DEVICE_TYPE
from medley.spec.cluster_load import cluster_from_dict
from medley.spec.model_arg import get_model

PROFILE = Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json"
TINY = get_model("tiny")
MBS, SEQ = 2, 128
MODES = ["none", "full", "selective", "full:1", "selective:1"]


def measured(first: int, last: int, recompute: Recompute) -> float:
    """Bytes one micro-batch's forward (with the loss on the last stage) leaves alive on a stage of
    layers [first, last), with its input and without its output (the next stage's input)."""
    stage = Decoder(TINY, first_layer=first, last_layer=last, seed=1, recompute=recompute)
    gen = torch.Generator().manual_seed(2)
    if first == 0:
        x = torch.randint(0, TINY.vocab_size, (MBS, SEQ), generator=gen)
    else:
        x = torch.randn(MBS, SEQ, TINY.hidden_size, generator=gen, requires_grad=True)
    targets = torch.randint(0, TINY.vocab_size, (MBS, SEQ), generator=gen)
    tracker = LiveTensorBytes([*stage.parameters(), x])
    base = tracker.live()
    with tracker:
        out = stage(x)
        last_stage = last == TINY.num_layers
        if last_stage:
            out = token_loss_sum(out, targets)
        held = tracker.live() - base
    return float(held + x.untyped_storage().nbytes() - (0 if last_stage else out.untyped_storage().nbytes()))


def predicted(split: str, recompute: str, *, tp: int = 1) -> list[float]:
    """The activation bytes the compiler books per stage of a two-stage pipeline of tiny (``tp`` > 1:
    tensor parallel with sequence parallelism on both stages)."""
    profile = load_profile(PROFILE).model_copy(update={"overhead": None})
    cost = ProfileCostSource(profile=profile, name=PROFILE.name, model=TINY)
    nodes = [{"name": "cpus", "device": CPU_DEVICE_TYPE, "count": 2 * tp}]
    cluster = cluster_from_dict({"name": "cpus", "nodes": nodes}, source="test")
    layout = inline_layout(cluster=cluster, model=TINY, cost=cost, pp=2, dp=1, schedule="1f1b",
                           micro_batches="2", micro_batch_size=MBS, seq_len=SEQ, zero="0,0", split=split,
                           dtype="fp32", recompute_mode=recompute, tp=None if tp == 1 else f"{tp},{tp}",
                           sequence_parallel=tp > 1)
    return [c.activation_bytes for c in compile_problem(layout, cluster, cost).stage_costs[0]]


@pytest.mark.parametrize("mode", MODES)
def test_each_ranks_activation_bytes_are_the_booked_ones(mode: str) -> None:
    rc = parse_recompute(mode)
    booked = predicted("3,3", mode)
    got = [measured(0, 3, rc), measured(3, 6, rc)]
    print(mode, [f"{g / 1e6:.3f}/{b / 1e6:.3f} MB" for g, b in zip(got, booked, strict=True)])
    for rank, (g, b) in enumerate(zip(got, booked, strict=True)):
        assert g == pytest.approx(b, rel=0.05), f"rank {rank} {mode}: measured {g:.0f} B, booked {b:.0f} B"


def test_selective_keeps_exactly_the_formulas_tensors_and_less_than_none() -> None:
    """A stage of blocks only: what selective recomputation keeps is the input and the matmuls' and
    attention's outputs, byte for byte; full keeps the inputs; none keeps more than selective."""
    kw = {"micro_batch_size": MBS, "seq_len": SEQ, "dtype_bytes": 4}
    blocks = range(1, 5)
    held = {mode: measured(1, 5, parse_recompute(mode)) for mode in ("none", "full", "selective")}
    # The stage's input is the first block's input; the output is left out (the next stage's).
    assert held["selective"] == sum(formulas.layer_activation_bytes(TINY, i, recompute="selective", **kw)
                                    for i in blocks)
    assert held["full"] == sum(formulas.layer_activation_bytes(TINY, i, recompute="full", **kw)
                               for i in blocks)
    assert held["full"] < held["selective"] < held["none"]


@pytest.mark.timeout(300)
def test_tp2_sequence_parallel_ranks_hold_the_booked_bytes_per_mode(tmp_path: Path) -> None:
    """Two stages of tiny at tp 2 with sequence parallelism on gloo (the edge between them a
    sequence shard): what each rank's forward leaves alive, per recomputation mode, against the
    booked activation bytes (the tp 1 profile through the memory model's TP and SP shares and the
    recompute formulas): within 5% on both stages."""
    from equality_worker import Case
    from test_equality import launch
    from tp_bytes_worker import RECOMPUTE_MODES, count_sp_recompute_bytes

    case = Case(name="sp-recompute", pp=1, dp=1, split=(3, 3), zero=(0,), tp=(2,))
    got = launch(2, [case], tmp_path, body=count_sp_recompute_bytes)[case.name]
    assert "error" not in got, got["error"]
    booked = {mode: predicted("3,3", mode, tp=2) for mode in RECOMPUTE_MODES}
    for mode in RECOMPUTE_MODES:
        print(mode, [f"{got[f'{mode}/{s}'] / 1e6:.3f}/{booked[mode][s] / 1e6:.3f} MB" for s in range(2)])
    for mode in RECOMPUTE_MODES:
        for s in range(2):
            g, b = got[f"{mode}/{s}"], booked[mode][s]
            assert g == pytest.approx(b, rel=0.05), f"stage {s} {mode}: measured {g:.0f} B, booked {b:.0f} B"
