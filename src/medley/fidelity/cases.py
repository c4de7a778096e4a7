"""The plans the fidelity study runs (bench/fidelity.py, ``medley fidelity``).

Written-out plans over two models cover pipelines and data parallelism, every schedule family
the runtime runs (GPipe, 1F1B, hetero-1F1B, ZB-H1, interleaved), ZeRO 0-3 with layer buckets and
streamed ZeRO-3, recompute, gradient clipping, uneven splits and uneven replicas, emulated slow
ranks, tensor parallelism (tp2 alone, with pp2, and tp2 then tp1), replica groups of their own
shape, 2 to 4 ranks, fp32 and bf16 autocast; the rest are taken straight from ``medley plan``'s
ranking on small emulated clusters (bf16, as the planner plans), where plans live.
"""

from __future__ import annotations

from medley.fidelity.plans import FidelityCase
from medley.spec.model import ModelSpec
from medley.spec.model_arg import get_model

# A "small" LLaMA-style model: ~10x the tiny preset's compute per block, still seconds per run on CPU.
SMALL = ModelSpec(
    name="small",
    vocab_size=256,
    hidden_size=256,
    num_blocks=4,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=688,
    mlp="swiglu",
    norm="rmsnorm",
    position="rope",
    max_seq_len=256,
    tied_embeddings=False,
    bias=False,
)
TINY = get_model("tiny")
PLANNER_CLUSTERS = ((1.0, 1.0), (1.0, 2.0), (1.0, 1.0, 1.5, 1.5))  # slowdowns of the planned clusters


def _classic() -> list[FidelityCase]:
    """The first study's fourteen plans: fp32, unclipped, one bucket, one gather window."""
    tiny, small = TINY, SMALL
    return [
        FidelityCase(name="tiny-pp2-1f1b", model=tiny, pp=2, dp=1, split="2,2", zero="0,0"),
        FidelityCase(
            name="tiny-pp2-gpipe-uneven", model=tiny, pp=2, dp=1, schedule="gpipe", split="1,3", zero="0,0"
        ),
        FidelityCase(name="tiny-pp2-zbh1", model=tiny, pp=2, dp=1, schedule="zb-h1", split="2,2", zero="0,0"),
        FidelityCase(name="tiny-dp2-zero1", model=tiny, pp=1, dp=2, zero="1"),
        FidelityCase(name="tiny-dp2-zero3", model=tiny, pp=1, dp=2, zero="3"),
        FidelityCase(name="tiny-dp2-zero2-mb6+2", model=tiny, pp=1, dp=2, zero="2", micro_batches="6,2"),
        FidelityCase(
            name="tiny-pp2-slow2", model=tiny, pp=2, dp=1, split="3,1", zero="0,0", slowdowns=(1.0, 2.0)
        ),
        FidelityCase(
            name="small-pp2-1f1b", model=small, pp=2, dp=1, split="2,2", zero="0,0", micro_batch_size=1
        ),
        FidelityCase(name="small-dp2-zero2", model=small, pp=1, dp=2, zero="2", micro_batch_size=1),
        FidelityCase(
            name="small-pp2-slow1-zbh1",
            model=small,
            pp=2,
            dp=1,
            schedule="zb-h1",
            split="1,3",
            zero="0,0",
            micro_batch_size=1,
            slowdowns=(2.0, 1.0),
        ),
        FidelityCase(
            name="tiny-pp2-interleaved",
            model=tiny,
            pp=2,
            dp=1,
            schedule="interleaved",
            split="1,1,1,1",
            zero="0,0,0,0",
        ),
        FidelityCase(name="tiny-pp2dp2-zero1", model=tiny, pp=2, dp=2, split="2,2", zero="1,1"),
        FidelityCase(
            name="tiny-pp4-1f1b",
            model=tiny,
            pp=4,
            dp=1,
            split="1,1,1,1",
            zero="0,0,0,0",
            micro_batches="8",
            micro_batch_size=1,
        ),
        FidelityCase(
            name="small-pp2dp2-zero3,2-mb6+2-slow",
            model=small,
            pp=2,
            dp=2,
            split="2,2",
            zero="3,2",
            micro_batches="6,2",
            micro_batch_size=1,
            slowdowns=(1.0, 1.5, 1.0, 1.5),
        ),
    ]


def _planner_regime() -> list[FidelityCase]:
    """What the planner emits: clipping, buckets, streamed ZeRO-3, recompute, hetero-1F1B, uneven
    replicas, bf16 autocast."""
    tiny, small = TINY, SMALL
    return [
        FidelityCase(
            name="tiny-pp2-1f1b-clip", model=tiny, pp=2, dp=1, split="2,2", zero="0,0", clip_grad=True
        ),
        FidelityCase(
            name="tiny-dp2-zero3-stream-b4-clip",
            model=tiny,
            pp=1,
            dp=2,
            zero="3",
            buckets=4,
            gather_windows=0,
            clip_grad=True,
        ),
        FidelityCase(
            name="tiny-dp2-zero2-b4-clip", model=tiny, pp=1, dp=2, zero="2", buckets=4, clip_grad=True
        ),
        FidelityCase(
            name="tiny-dp2-zero1-b4-clip", model=tiny, pp=1, dp=2, zero="1", buckets=4, clip_grad=True
        ),
        FidelityCase(
            name="tiny-pp2-recompute", model=tiny, pp=2, dp=1, split="2,2", zero="0,0", recompute=True
        ),
        FidelityCase(
            name="tiny-pp2-selective", model=tiny, pp=2, dp=1, split="2,2", zero="0,0",
            recompute_mode="selective",
        ),
        FidelityCase(
            name="tiny-pp2-full1-selective1", model=tiny, pp=2, dp=1, split="2,2", zero="0,0",
            recompute_mode="full:1,selective:1",
        ),
        FidelityCase(
            name="small-dp2-zero3-stream-b4-recompute-clip",
            model=small,
            pp=1,
            dp=2,
            zero="3",
            buckets=4,
            gather_windows=0,
            recompute=True,
            clip_grad=True,
            micro_batch_size=1,
        ),
        FidelityCase(
            name="tiny-pp2-hetero1f1b-slow2",
            model=tiny,
            pp=2,
            dp=1,
            schedule="hetero-1f1b",
            warmup=(3, 1),
            split="3,1",
            zero="0,0",
            slowdowns=(1.0, 2.0),
            clip_grad=True,
        ),
        FidelityCase(
            name="tiny-pp2dp2-hetero1f1b-mb5+3",
            model=tiny,
            pp=2,
            dp=2,
            schedule="hetero-1f1b",
            warmup=(3, 1),
            split="2,2",
            zero="1,1",
            micro_batches="5,3",
            clip_grad=True,
        ),
        FidelityCase(
            name="tiny-dp2-zero0-mb6+2-clip",
            model=tiny,
            pp=1,
            dp=2,
            zero="0",
            micro_batches="6,2",
            clip_grad=True,
        ),
        FidelityCase(
            name="tiny-pp2-1f1b-bf16", model=tiny, pp=2, dp=1, split="2,2", zero="0,0", dtype="bf16"
        ),
        FidelityCase(
            name="tiny-dp2-zero3-stream-b4-bf16-clip",
            model=tiny,
            pp=1,
            dp=2,
            zero="3",
            buckets=4,
            gather_windows=0,
            clip_grad=True,
            dtype="bf16",
        ),
        FidelityCase(
            name="tiny-pp2-zbh1-bf16-clip",
            model=tiny,
            pp=2,
            dp=1,
            schedule="zb-h1",
            split="2,2",
            zero="0,0",
            clip_grad=True,
            dtype="bf16",
        ),
    ]


def _tensor_parallel() -> list[FidelityCase]:
    """Tensor parallelism (each TP group one emulated node): tp2 alone, under a pipeline, and a
    replica whose first pipeline rank has tp2 and the second tp1 (3 ranks)."""
    tiny = TINY
    return [
        FidelityCase(name="tiny-tp2", model=tiny, pp=1, dp=1, zero="0", tp="2"),
        FidelityCase(name="tiny-tp2-pp2", model=tiny, pp=2, dp=1, split="2,2", zero="0,0", tp="2"),
        FidelityCase(name="tiny-pp2-tp2,1", model=tiny, pp=2, dp=1, split="2,2", zero="0,0", tp="2,1"),
    ]


def _replica_groups() -> list[FidelityCase]:
    """Replica groups of their own shape (3 ranks): a pp-2 replica beside a replica of the whole
    model, at ZeRO-1 and ZeRO-3 on the segments they share, and with the whole-model replica on an
    emulated slow device and fewer micro-batches."""
    tiny = TINY
    pipeline = dict(pp=2, dp=1, split="1,3", micro_batches="4")
    whole = dict(pp=1, dp=1, split="4", micro_batches="4")
    return [
        FidelityCase(name="tiny-groups-pp2+pp1-zero1", model=tiny,
                     groups=({**pipeline, "zero": "1,1"}, {**whole, "zero": "1"})),
        FidelityCase(name="tiny-groups-pp2+pp1-zero3", model=tiny,
                     groups=({**pipeline, "zero": "3,3"}, {**whole, "zero": "3"})),
        FidelityCase(name="tiny-groups-pp2+slow-pp1", model=tiny, slowdowns=(1.0, 1.0, 2.0),
                     groups=({**pipeline, "micro_batches": "6", "zero": "1,1"},
                             {**whole, "micro_batches": "2", "zero": "1"})),
    ]


def planned_cases(*, top: int = 2) -> list[FidelityCase]:
    """The planner's ``top`` plans on each of :data:`PLANNER_CLUSTERS` (tiny model, bf16, 8
    sequences of 128 tokens per step)."""
    cases = []
    for slowdowns in PLANNER_CLUSTERS:
        label = "+".join(f"{f:g}" for f in slowdowns)
        cases += [
            FidelityCase(
                name=f"plan-tiny-{label}-top{k}",
                model=TINY,
                slowdowns=slowdowns,
                from_planner=k,
                global_batch=8,
                dtype="bf16",
            )
            for k in range(1, top + 1)
        ]
    return cases


def default_cases() -> list[FidelityCase]:
    """Every case: the first study's, the planner's regime, tensor parallelism, replica groups of
    their own shape, and the planner's own plans."""
    return _classic() + _planner_regime() + _tensor_parallel() + _replica_groups() + planned_cases()


QUICK = ("tiny-pp2-1f1b-clip", "tiny-dp2-zero1-b4-clip")


def quick_cases() -> list[FidelityCase]:
    """Two plans of the planner's regime (fp32, one profile): a clipped pipeline, and clipped
    ZeRO-1 with layer buckets (what the planner picks first for two CPU ranks)."""
    return [c for c in default_cases() if c.name in QUICK]
