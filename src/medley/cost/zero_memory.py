"""Memory per device of one pipeline stage under ZeRO level 0..3 with mixed-precision Adam.

Per parameter (Rajbhandari et al., "ZeRO", SC'20, §5): 2 bytes of half-precision weights, 2 bytes
of half-precision gradients and K = 12 bytes of optimizer state (fp32 master weights, momentum,
variance). Over a data-parallel group of N_d devices:

==========  ===================  =======================================
level       resident per device  the paper's formula (Ψ parameters)
==========  ===================  =======================================
0           2 + 2 + 12           16 Ψ
1           2 + 2 + 12/N_d       4 Ψ + 12 Ψ / N_d
2           2 + 2/N_d + 12/N_d   2 Ψ + 14 Ψ / N_d
3           (2 + 2 + 12)/N_d     16 Ψ / N_d
==========  ===================  =======================================

Inside a pipeline, gradients of many micro-batches accumulate before they are reduced. Levels 2
and 3 only reach the sharded gradient of the table if the accumulation itself is sharded, that is
if each micro-batch's gradient is reduce-scattered as it is produced (DeepSpeed's ZeRO-2 does this
at every micro-step, which is why it refuses pipelining). medley makes this a per-stage choice,
``grad_windows``: the number of reduce-scatters per step. With one window the stage accumulates a
full gradient buffer (2 Ψ) until its single reduce-scatter at the end of the step; with one
window per micro-batch only a bucket of gradient is unsharded at any time. ZeRO-3 likewise holds
gathered half-precision weights between UNSHARD and RESHARD: the whole stage when it is kept
gathered across the step, one or two buckets when it is gathered bucket by bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.cost.zero_levels import zero_level

WEIGHT_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytesPerParam:
    """Bytes per parameter of the weights, the gradient and the optimizer state.

    Attributes:
        weights / grads / optimizer: bytes per parameter of each.
        weight_dtype: the dtype weights are computed in and gathered in (ZeRO-3 UNSHARD, the
            ZeRO-1/2 gather after the step).
        grad_dtype: the dtype gradients accumulate and are reduced in (REDUCE_GRAD).
    """

    weights: float
    grads: float
    optimizer: float
    weight_dtype: str
    grad_dtype: str

    @property
    def total(self) -> float:
        """Bytes of the whole state per parameter, unsharded."""
        return self.weights + self.grads + self.optimizer


# fp16 mixed precision with Adam: the ZeRO paper's table above (fp16 weights and gradients, fp32
# master, momentum and variance: 12 B), as DeepSpeed runs fp16 and medley's runtime runs fp16 plans.
MIXED_PRECISION_ADAM = StateBytesPerParam(weights=WEIGHT_BYTES, grads=GRAD_BYTES, optimizer=OPTIMIZER_BYTES,
                                          weight_dtype="fp16", grad_dtype="fp16")
# bf16 as Megatron-LM and torchtitan run it (and medley's runtime): bf16 weights, gradients
# accumulated and reduced in fp32 (bf16's 8-bit mantissa loses small micro-batch gradients), fp32
# master, momentum and variance: 18 B per parameter unsharded.
BF16_ADAM = StateBytesPerParam(weights=2, grads=4, optimizer=OPTIMIZER_BYTES, weight_dtype="bf16",
                               grad_dtype="fp32")
# Plain fp32 training with Adam(W), as medley's runtime runs fp32 plans: fp32 weights and gradients
# and two fp32 moments; no master copy, since the weights already are fp32.
FP32_ADAM = StateBytesPerParam(weights=4, grads=4, optimizer=8, weight_dtype="fp32", grad_dtype="fp32")

_BY_DTYPE = {"fp32": FP32_ADAM, "bf16": BF16_ADAM, "fp16": MIXED_PRECISION_ADAM}


def state_bytes_per_param(dtype: str) -> StateBytesPerParam:
    """Per-parameter model-state bytes of a plan trained in ``dtype`` (bf16, fp16 or fp32)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"training dtype must be one of {', '.join(_BY_DTYPE)}, got {dtype!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class StageStateBytes:
    """Bytes per device of one stage's model state, split by what ZeRO shards.

    Attributes:
        weights: resident half-precision weights (a shard under level 3).
        grads: resident gradient (a shard under levels 2 and 3, full below).
        optimizer: fp32 master weights, momentum and variance (a shard from level 1).
        gathered_weights: transient, level 3 only: unsharded weights held between UNSHARD and
            RESHARD at the peak (whole stage or buckets, see ``gathered_fraction``).
        grad_accumulation: transient, levels 2 and 3: the unsharded gradient buffer held until
            its reduce-scatter (whole stage with one window, one bucket with per-micro-batch).
    """

    weights: float
    grads: float
    optimizer: float
    gathered_weights: float = 0.0
    grad_accumulation: float = 0.0

    @property
    def resident(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        return self.resident + self.gathered_weights + self.grad_accumulation


def stage_state_bytes(
    params: float,
    *,
    level: int,
    dp: int,
    gathered_fraction: float = 1.0,
    accumulation_fraction: float = 1.0,
    per_param: StateBytesPerParam = MIXED_PRECISION_ADAM,
) -> StageStateBytes:
    """Model-state bytes per device for a stage of ``params`` parameters.

    Args:
        params: parameters of the stage.
        level: ZeRO level 0..3.
        dp: size of the stage's data-parallel group.
        gathered_fraction: level 3: fraction of the stage's weights gathered at the peak
            (1.0 when kept gathered across the step; two buckets' share when bucketed).
        accumulation_fraction: levels 2-3: fraction of the stage's gradient held unsharded at
            the peak (1.0 with one reduce-scatter per step; a bucket's share when reduced per
            micro-batch).
        per_param: bytes per parameter of weights, gradient and optimizer state (mixed-precision
            Adam by default; :data:`FP32_ADAM` for fp32 plans).
    """
    meaning = zero_level(level)
    if dp < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp}")
    shard = params / dp
    w, g, o = per_param.weights, per_param.grads, per_param.optimizer
    weights = (shard if meaning.shards_weights else params) * w
    grads = (shard if meaning.shards_grads else params) * g
    optimizer = (shard if meaning.shards_optimizer else params) * o
    gathered = 0.0
    accumulation = 0.0
    if meaning.shards_weights and dp > 1:
        gathered = (params - shard) * w * min(1.0, gathered_fraction)
    if meaning.shards_grads and dp > 1:
        accumulation = (params - shard) * g * min(1.0, accumulation_fraction)
    return StageStateBytes(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        gathered_weights=gathered,
        grad_accumulation=accumulation,
    )


def zero_paper_bytes(params: float, *, level: int, dp: int) -> float:
    """The ZeRO paper's per-device total (table above), with no transient buffers."""
    k = OPTIMIZER_BYTES
    return {
        0: (4 + k) * params,
        1: 4 * params + k * params / dp,
        2: 2 * params + (2 + k) * params / dp,
        3: (4 + k) * params / dp,
    }[level]
