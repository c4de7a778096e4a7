"""Memory per device of one pipeline stage under ZeRO level 0..3 with Adam, as medley's runtime
holds it.

The ZeRO paper (Rajbhandari et al., SC'20, §5) counts 2 bytes of half-precision weights, 2 of
half-precision gradients and K = 12 of optimizer state (fp32 master, momentum, variance) per
parameter: 16 Ψ, 4 Ψ + 12 Ψ/N_d, 2 Ψ + 14 Ψ/N_d and 16 Ψ/N_d at levels 0-3 (Ψ parameters, N_d
devices; :func:`zero_paper_bytes`). medley's runtime runs levels 1-3 as FSDP2 units
(:mod:`medley.runtime.sharding`) and differs from that table where FSDP2 does:

* **the stepped shard.** Each member keeps its fp32 shard of the weights (the parameter its
  optimizer steps: the master in half precision, the weights themselves in fp32) and, at levels
  1-2, the gathered weights in the compute dtype all step. In fp32 the shard is a copy beyond the
  gathered weights (4 Ψ/N_d more); in half precision it is the master the optimizer's 12 B count.
  Level 3 keeps no half-precision shard: it gathers from the fp32 one.
* **whole gathers.** Level 3 gathers a bucket's whole weights in the compute dtype, next to the
  shard (not only the part the member lacks), and every bucket of the stage for each compute
  action: the schedule's UNSHARDs all precede the F or BW, one autograd call over every layer
  (streamed ZeRO-3 included: buckets split its collectives, not its compute).
* **gradients are made, not kept.** Between steps there is no gradient (the optimizer's
  ``zero_grad`` frees it). Autograd makes the stage's whole unsharded gradient (in the gradients'
  accumulation dtype: fp32 for bf16, FSDP2 upcasting each backward's bf16 gradient; fp16 for fp16)
  at the stage's backward; it lives until the step's end at level 0, until the reduce-scatter at
  levels 1-3, whose gradient shard then stays until the step's end.
* **the reduction's flat buffer.** A gradient reduction copies a bucket's gradient into one
  flat buffer: level 0's all-reduce sums it in place and keeps it as the reduced gradient (the
  gradient it came from is freed), levels 1-3's reduce-scatter input stays with FSDP2 until its
  next reduction (one bucket's at a time).

Per device, Ψ the stage's (held) parameters, w / g / K the bytes per parameter of weights,
gradients and optimizer state, d the dp group:

======  ===========================  ==============  ==========================================
level   weights (all step)           optimizer       transient
======  ===========================  ==============  ==========================================
0       w Ψ in fp32, 0 in half       K Ψ             gradient 4 Ψ; reducing, a bucket's g Ψ_b
1       w Ψ (+ 4 Ψ/d in fp32)        K Ψ/d           gradient g Ψ, a bucket's g Ψ_b, the shard 4 Ψ/d
2       w Ψ (+ 4 Ψ/d in fp32)        K Ψ/d           as level 1
3       4 Ψ/d in fp32, else 0        K Ψ/d           as level 1, and the gathered weights w Ψ
======  ===========================  ==============  ==========================================

The gradient autograd makes at level 0 is the fp32 master's (4 B whatever g is: fp16 plans
reduce it in an fp16 buffer and copy the sum back), and the shard FSDP2 reduces into is its fp32
shard's (4 B); g is what FSDP2 accumulates and reduces in (fp16 in fp16 plans).

Without FSDP2 (level 0, or d = 1) half precision computes under autocast from the fp32 master
(the optimizer's parameter): no resident half-precision weights, but each forward casts its
matmuls' weights and keeps the copies for its backward, w per cast parameter and micro-batch in
flight (:func:`autocast_copy_bytes`, with the activations).

Levels 1 and 2 differ in when they reduce (once per step, or per gradient window), not in what
they hold at the peak. With d = 1 nothing is sharded and nothing gathered: every level holds
level 0's state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from medley.cost.zero_levels import fsdp_units, zero_level

WEIGHT_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12
FP32_BYTES = 4


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
    def master_in_optimizer(self) -> bool:
        """Whether the fp32 weights the optimizer steps are part of ``optimizer`` (half precision)
        rather than the weights themselves (fp32)."""
        return self.weights < 4

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
    """Bytes per device of one stage's model state (module docstring's table).

    Attributes:
        weights: resident all step: the weights (levels 0-2: whole, in the compute dtype) and, in
            fp32 at levels 1-3, the FSDP2 shard the optimizer steps.
        optimizer: the optimizer state (the fp32 master in half precision, momentum, variance;
            a shard from level 1).
        gathered_weights: transient, level 3: the stage's whole weights, gathered in the compute
            dtype for compute.
        gradient: transient: the stage's whole unsharded gradient, from its backward until the
            reduce-scatter (levels 1-3) or the step's end (level 0).
        grad_shard: transient, levels 1-3: the reduced gradient shard, from the first
            reduce-scatter until the step's end.
        reduce_buffer: transient with dp > 1: the flat buffer of one bucket's gradient
            reduction (its largest bucket's, ``bucket_fraction`` of the stage).
    """

    weights: float
    optimizer: float
    gathered_weights: float = 0.0
    gradient: float = 0.0
    grad_shard: float = 0.0
    reduce_buffer: float = 0.0

    @property
    def resident(self) -> float:
        """Held between steps."""
        return self.weights + self.optimizer

    @property
    def peak(self) -> float:
        """Everything at once: the most the state can hold at any moment."""
        return self.resident + self.gathered_weights + self.gradient + self.grad_shard + self.reduce_buffer


def stage_state_bytes(
    params: float,
    *,
    level: int,
    dp: int,
    per_param: StateBytesPerParam = MIXED_PRECISION_ADAM,
    bucket_fraction: float = 1.0,
) -> StageStateBytes:
    """Model-state bytes per device for a stage of ``params`` parameters.

    Args:
        params: parameters of the stage.
        level: ZeRO level 0..3.
        dp: size of the stage's data-parallel group.
        per_param: bytes per parameter of weights, gradient and optimizer state (mixed-precision
            Adam by default; :data:`FP32_ADAM` for fp32 plans).
        bucket_fraction: the stage's largest reduction bucket, as a fraction of its parameters.
    """
    meaning = zero_level(level)
    if dp < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp}")
    w, g, o = per_param.weights, per_param.grads, per_param.optimizer
    sharded = fsdp_units(level, dp)
    shard = params / dp
    master = 0.0 if per_param.master_in_optimizer or not sharded else shard * FP32_BYTES
    gathered = sharded and meaning.shards_weights
    compute_copy = not gathered and (sharded or not per_param.master_in_optimizer)
    # Autograd differentiates the weights the layers hold: without FSDP2 the fp32 master, so the
    # gradient is fp32 whatever the table's dtype; FSDP2's reduced shard takes its fp32 shard's.
    fp32_grad = FP32_BYTES if per_param.master_in_optimizer else g
    return StageStateBytes(
        weights=master + (params * w if compute_copy else 0.0),
        optimizer=(shard if sharded else params) * o,
        gathered_weights=params * w if gathered else 0.0,
        gradient=params * (g if sharded else fp32_grad),
        grad_shard=shard * fp32_grad if sharded else 0.0,
        reduce_buffer=params * bucket_fraction * g if dp > 1 else 0.0,
    )


def frozen_state_bytes(params: float, *, level: int, dp: int,
                       per_param: StateBytesPerParam) -> StageStateBytes:
    """Bytes per device of ``params`` frozen parameters (a LoRA run's base, :mod:`medley.spec.adapter`),
    which the runtime holds in the compute dtype (w B each: no fp32 master, no gradient, no
    optimizer state): whole at level 0; FSDP2's shard and the gathered weights at levels 1-2; the
    shard, and the weights gathered for compute, at level 3."""
    meaning = zero_level(level)
    sharded = fsdp_units(level, dp)
    gathered = sharded and meaning.shards_weights
    w = per_param.weights
    return StageStateBytes(weights=(params / dp * w if sharded else 0.0) + (0.0 if gathered else params * w),
                           optimizer=0.0, gathered_weights=params * w if gathered else 0.0)


def adapted_state_bytes(params: float, *, trained: float | None, level: int, dp: int,
                        per_param: StateBytesPerParam, bucket_fraction: float = 1.0) -> StageStateBytes:
    """:func:`stage_state_bytes` of a stage whose ``trained`` parameters of ``params`` train and the
    rest are frozen (:func:`frozen_state_bytes`); ``trained`` None: every parameter trains."""
    shape = {"level": level, "dp": dp}
    if trained is None:
        return stage_state_bytes(params, per_param=per_param, bucket_fraction=bucket_fraction, **shape)
    parts = [frozen_state_bytes(params - trained, per_param=per_param, **shape),
             stage_state_bytes(trained, per_param=per_param, bucket_fraction=bucket_fraction, **shape)]
    return StageStateBytes(**{f.name: sum(getattr(part, f.name) for part in parts)
                              for f in dataclasses.fields(StageStateBytes)})


def autocast_copy_bytes(*, level: int, dp: int, per_param: StateBytesPerParam) -> float:
    """Bytes per cast parameter (:func:`medley.cost.formulas.layer_autocast_params`) that each
    micro-batch in flight holds: autocast's compute-dtype copies of fp32 weights, kept for the
    backward (half precision without FSDP2, which gathers the compute-dtype weights instead)."""
    return per_param.weights if per_param.master_in_optimizer and not fsdp_units(level, dp) else 0.0


def zero_paper_bytes(params: float, *, level: int, dp: int) -> float:
    """The ZeRO paper's per-device total (table above), with no transient buffers."""
    k = OPTIMIZER_BYTES
    return {
        0: (4 + k) * params,
        1: 4 * params + k * params / dp,
        2: 2 * params + (2 + k) * params / dp,
        3: (4 + k) * params / dp,
    }[level]
