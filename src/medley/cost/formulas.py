"""Closed-form per-layer costs: parameters, FLOPs per pass, activation bytes, boundary bytes.

Layers follow :meth:`ModelSpec.layers`: 0 embedding, 1..num_blocks blocks, last = norm + head + loss.
FLOPs count a multiply-add as 2 and attention scores over the full (not causal-halved) square,
which is what the Megatron formula (research/schedules_sim.md §3) counts. B is the input-gradient
backward and W the weight-gradient backward: a linear layer's B and W each cost its forward; the
weight-free attention core costs 2x its forward, all in B.

Tensor parallelism (``tp``, Megatron-style; sequence parallelism where asked): a block's Q/K/V and MLP
gate/up matrices are split by output columns and its attention output and MLP down matrices by
input rows over ``tp`` ranks, so each rank holds and multiplies 1/tp of them; norms, the
embedding and the head are replicated. Of the activations a block keeps, those inside attention
and the MLP (Q/K/V, the attention output, the MLP's inner tensors, the attention
log-sum-exp) are split; the block input and the norms' inputs and outputs are whole on every
rank (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022, Eq. 2: sbh(10 + 24/t + 5as/(ht)) counts the same split).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from medley.cost.interfaces import Pass
from medley.spec.adapter import LoraSpec
from medley.spec.model import ModelSpec

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of each compute dtype (activations, gathered weights, messages)."""

RecomputeMode = bool | str  # a mode of medley.cost.recompute.MODES; True is "full", False "none"


def _mode(recompute: RecomputeMode) -> str:
    if isinstance(recompute, bool):
        return "full" if recompute else "none"
    return recompute


@dataclass(frozen=True, kw_only=True, slots=True)
class Gemm:
    """A forward matmul of ``tokens x in_features`` by ``in_features x out_features``."""

    tokens: int
    in_features: int
    out_features: int

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.in_features * self.out_features

    def shape(self, kind: Pass) -> tuple[int, int, int]:
        """(m, n, k) of the matmul this pass runs: F Y=XW, B dX=dY W^T, W dW=X^T dY."""
        if kind is Pass.F:
            return self.tokens, self.out_features, self.in_features
        if kind is Pass.B:
            return self.tokens, self.in_features, self.out_features
        return self.in_features, self.out_features, self.tokens


def _norm_params(model: ModelSpec) -> int:
    return model.hidden_size * (2 if model.norm == "layernorm" else 1)


def _block_params(model: ModelSpec, tp: int = 1) -> float:
    """A block's parameters on one of ``tp`` ranks: the column-parallel matrices and biases
    (Q/K/V, gate/up) and the row-parallel matrices (attention output, down) split, the
    row-parallel biases and the norms whole."""
    h, q, kv, ffn = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    qkv_bias = q + 2 * kv if model.bias or model.qkv_bias else 0
    attention = (h * (q + 2 * kv) + q * h + qkv_bias) / tp + (h if model.bias else 0)
    if model.mlp == "swiglu":
        mlp = (3 * h * ffn + (2 * ffn if model.bias else 0)) / tp + (h if model.bias else 0)
    else:
        mlp = (2 * h * ffn + (ffn if model.bias else 0)) / tp + (h if model.bias else 0)
    whole = attention + mlp + 2 * _norm_params(model)
    return int(whole) if tp == 1 else whole


def _projection_params(model: ModelSpec) -> int:
    """One of OPT-350M's project_in / project_out matrices (0 when the embedding is full width)."""
    return model.embed_dim * model.hidden_size if model.embed_dim != model.hidden_size else 0


def layer_params(model: ModelSpec, layer_index: int, *, tp: int = 1) -> float:
    """Parameters owned by a layer (on one of ``tp`` tensor-parallel ranks). A tied LM head owns
    none: its weight is counted at layer 0."""
    kind = model.layer_kind(layer_index)
    if kind == "embedding":
        positions = model.max_seq_len * model.hidden_size if model.position == "learned" else 0
        return model.vocab_size * model.embed_dim + positions + _projection_params(model)
    if kind == "block":
        return _block_params(model, tp)
    head = 0 if model.tied_embeddings else model.vocab_size * model.embed_dim
    return _norm_params(model) + head + _projection_params(model)


def layer_held_params(model: ModelSpec, layer_index: int, *, tp: int = 1) -> float:
    """Parameters a stage holding this layer keeps in memory (per tensor-parallel rank): a tied
    head keeps its own copy."""
    extra = model.vocab_size * model.embed_dim if model.layer_kind(layer_index) == "head" else 0
    return layer_params(model, layer_index, tp=tp) + (extra if model.tied_embeddings else 0)


def layer_autocast_params(
    model: ModelSpec, layer_index: int, *, tp: int = 1, recompute: RecomputeMode = False,
    adapter: LoraSpec | None = None,
) -> float:
    """Weights whose compute-dtype copies a layer's forward keeps under autocast, per
    tensor-parallel rank: its matmuls' matrices (a tied head's borrowed embedding too), which the
    backward needs for the input gradient; not biases (no backward needs them), norms (autocast
    runs them in fp32) nor an embedding table (lookups are not cast). A recomputing block keeps
    none (its forward reruns inside the backward; selective recomputation reruns the casts too).
    With ``adapter`` (LoRA) the frozen base is held in the compute dtype: only the adapters are cast."""
    kind = model.layer_kind(layer_index)
    if kind == "block" and _mode(recompute) != "none":
        return 0.0
    if adapter is not None:
        return layer_adapter_params(model, adapter, layer_index, tp=tp)
    if kind == "embedding":
        return float(_projection_params(model))
    if kind == "block":
        h, q, kv, ffn = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
        return (h * (q + 2 * kv) + q * h + (3 if model.mlp == "swiglu" else 2) * h * ffn) / tp
    return float(model.vocab_size * model.embed_dim + _projection_params(model))


@lru_cache(maxsize=1 << 16)  # the planner's estimates and the compiler ask for the same stages often
def stage_held_params(model: ModelSpec, first: int, last: int, *, tp: int = 1) -> float:
    """Parameters a stage holding layers ``[first, last)`` keeps per tensor-parallel rank: a tied
    head's copy only when the stage lacks the embedding (with it, the head borrows the
    embedding's weight)."""
    held = sum(layer_held_params(model, i, tp=tp) for i in range(first, last))
    both_ends = first == 0 and last == model.num_layers
    return held - (model.vocab_size * model.embed_dim if model.tied_embeddings and both_ends else 0)


def layer_adapter_params(model: ModelSpec, adapter: LoraSpec | None, layer_index: int, *,
                         tp: int = 1) -> float:
    """LoRA adapter parameters (:mod:`medley.spec.adapter`) of one layer per tensor-parallel rank,
    beyond :func:`layer_held_params`' base: a block's adapters, 0 elsewhere or without one."""
    if adapter is None or model.layer_kind(layer_index) != "block":
        return 0.0
    return adapter.held_params(model, tp=tp)


def stage_adapter_params(model: ModelSpec, adapter: LoraSpec | None, first: int, last: int, *,
                         tp: int = 1) -> float:
    """:func:`layer_adapter_params` of layers ``[first, last)``."""
    return sum(layer_adapter_params(model, adapter, i, tp=tp) for i in range(first, last))


def stage_trained_params(model: ModelSpec, adapter: LoraSpec | None, first: int, last: int, *,
                         tp: int = 1) -> float:
    """The parameters of layers ``[first, last)`` that take gradients and optimizer state (per TP
    rank): the adapters of a LoRA run (its base is frozen), else all of :func:`stage_held_params`."""
    if adapter is None:
        return float(stage_held_params(model, first, last, tp=tp))
    return stage_adapter_params(model, adapter, first, last, tp=tp)


def weight_grad_share(model: ModelSpec, adapter: LoraSpec | None, layer_index: int, *, tp: int = 1) -> float:
    """The share of a layer's weight-gradient work (W) that remains when only ``adapter`` trains:
    a weight's gradient costs in proportion to its parameters, and a frozen one has none (1
    without an adapter)."""
    if adapter is None:
        return 1.0
    trained = layer_adapter_params(model, adapter, layer_index, tp=tp)
    return trained / (layer_held_params(model, layer_index, tp=tp) + trained)


def total_params(model: ModelSpec) -> int:
    return sum(layer_params(model, i) for i in range(model.num_layers))


def vocab_share(model: ModelSpec, tp: int, vocab_parallel: bool) -> int:
    """Vocabulary rows of the LM head one of ``tp`` ranks holds: all of them, or under
    ``vocab_parallel`` (Megatron-LM's vocabulary-parallel head and cross-entropy) its 1/tp slice,
    rounded up."""
    return -(-model.vocab_size // tp) if vocab_parallel and tp > 1 else model.vocab_size


def layer_gemms(
    model: ModelSpec, layer_index: int, *, micro_batch_size: int, seq_len: int, tp: int = 1,
    vocab_parallel: bool = False,
) -> list[Gemm]:
    """The layer's weight matmuls (forward shapes), as one of ``tp`` tensor-parallel ranks runs
    them: column-parallel matrices with 1/tp of the outputs, row-parallel with 1/tp of the inputs;
    the head's whole vocabulary, or under ``vocab_parallel`` its 1/tp slice (:func:`vocab_share`)."""
    t, h = micro_batch_size * seq_len, model.hidden_size
    kind = model.layer_kind(layer_index)
    proj = _projection_params(model) > 0
    if kind == "embedding":
        return [Gemm(tokens=t, in_features=model.embed_dim, out_features=h)] if proj else []
    if kind == "head":
        gemms = [Gemm(tokens=t, in_features=h, out_features=model.embed_dim)] if proj else []
        vocab = vocab_share(model, tp, vocab_parallel)
        return gemms + [Gemm(tokens=t, in_features=model.embed_dim, out_features=vocab)]
    ffn, q = model.ffn_hidden_size // tp, model.q_dim // tp
    up = [Gemm(tokens=t, in_features=h, out_features=ffn)] * (2 if model.mlp == "swiglu" else 1)
    return [
        Gemm(tokens=t, in_features=h, out_features=q + 2 * (model.kv_dim // tp)),  # fused QKV
        Gemm(tokens=t, in_features=q, out_features=h),  # attention output
        *up,
        Gemm(tokens=t, in_features=ffn, out_features=h),  # down
    ]


def attention_core_flops(model: ModelSpec, *, micro_batch_size: int, seq_len: int) -> float:
    """Forward FLOPs of softmax(QK^T)V in one block: 2·b·s²·(heads·head_dim) each for the scores
    and for AV (full causal maths, as the kernels compute it; a sliding window is a mask over the same
    square, so it is costed as full attention)."""
    return 4.0 * micro_batch_size * seq_len * seq_len * model.q_dim


def layer_flops(
    model: ModelSpec, layer_index: int, kind: Pass, *, micro_batch_size: int, seq_len: int
) -> float:
    """FLOPs of one pass (F, B or W) of a layer for one micro-batch."""
    linear = sum(
        g.flops for g in layer_gemms(model, layer_index, micro_batch_size=micro_batch_size, seq_len=seq_len)
    )
    if model.layer_kind(layer_index) != "block":
        return linear
    core = attention_core_flops(model, micro_batch_size=micro_batch_size, seq_len=seq_len)
    return linear + {Pass.F: core, Pass.B: 2.0 * core, Pass.W: 0.0}[kind]


def megatron_flops_per_step(model: ModelSpec, *, batch_size: int, seq_len: int) -> float:
    """Megatron's ``num_floating_point_operations`` (fwd + bwd, no recompute), for cross-checks."""
    b, s, n, h, v = batch_size, seq_len, model.num_blocks, model.hidden_size, model.vocab_size
    q_over_h, g_over_a = 1.0, model.num_kv_heads / model.num_heads
    ffn_term = model.ffn_hidden_size / h * (1.5 if model.mlp == "swiglu" else 1.0)
    return 12.0 * b * s * n * h * h * ((1 + g_over_a + s / h) * q_over_h + ffn_term + v / (2 * n * h))


def _block_activation_elements(model: ModelSpec, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Elements per token a block of medley's runtime (:mod:`medley.runtime.transformer`) saves for
    backward (flash-style attention, no dropout), per tensor-parallel rank.

    Saved: block input, attention-norm output, MLP-norm input and output (whole on every TP rank);
    split: Q after RoPE, K and V as attention reads them (repeated to every query head under
    grouped-query attention, so q_dim wide either way), the attention output twice (the kernel's,
    and the contiguous copy the output projection reads), and the MLP's inner tensors (SwiGLU:
    gate, its SiLU, up and their product; GELU: pre- and post-activation). Counted on CPU: the
    split tensors of a tiny-model block are exactly these, and halve at tp 2.

    With ``sequence_parallel`` the block input and the MLP-norm input are sequence shards (1/tp);
    the norms' outputs are kept as the all-gathered inputs of the column-wise layers (whole).
    """
    h, q, ffn = model.hidden_size, model.q_dim, model.ffn_hidden_size
    held = 2 * h + 2 * h / tp if sequence_parallel else 4 * h
    return held + (5 * q + ffn * (4 if model.mlp == "swiglu" else 2)) / tp


def _selective_elements(model: ModelSpec, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Elements per token a selectively recomputing block keeps (:mod:`medley.cost.recompute`): its
    input and the outputs of its weight matmuls and attention kernel. Split over TP: q, k and v as
    the matmuls make them (k and v kv_dim wide, before the GQA repeat), the attention output, the
    MLP's gate and up (GELU: up); whole: the input and the row-parallel matmuls' outputs (attention
    output and down projections, hidden wide before their all-reduce or reduce-scatter). Under
    ``sequence_parallel`` the input is the rank's sequence shard."""
    h, q, kv, ffn = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    held = (h / tp if sequence_parallel else h) + 2 * h
    return held + (2 * q + 2 * kv + ffn * (2 if model.mlp == "swiglu" else 1)) / tp


def _overlap_elements(model: ModelSpec, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Elements per token of a selective block's kept tensors that its rerun forward saves again
    for the backward (the same tensors, not copies): the input, the attention output and the MLP's
    gate and up (GELU: up); the input a sequence shard under ``sequence_parallel``."""
    h, q, ffn = model.hidden_size, model.q_dim, model.ffn_hidden_size
    return (h / tp if sequence_parallel else h) + (q + ffn * (2 if model.mlp == "swiglu" else 1)) / tp


def layer_activation_bytes(
    model: ModelSpec,
    layer_index: int,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    recompute: RecomputeMode = False,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Bytes a layer holds per in-flight micro-batch between its F and its B (per TP rank).

    ``recompute`` (a mode of :mod:`medley.cost.recompute`; True: ``full``): under ``full`` a block
    keeps only its input (whole on every TP rank) and reruns its forward before B; under
    ``selective`` it keeps its input and its matmuls' and attention kernel's outputs (with the
    kernel's log-sum-exp). Under ``sequence_parallel`` the kept input is the rank's sequence shard.
    """
    cut = tp if sequence_parallel and model.layer_kind(layer_index) == "block" else 1
    t = micro_batch_size * seq_len
    kind = model.layer_kind(layer_index)
    if kind == "embedding":
        return t * 8.0 + (t * model.embed_dim * dtype_bytes if _projection_params(model) else 0.0)
    if kind == "head":
        # Norm input and output, logits, and the fp32 log-softmax the loss keeps for backward.
        return t * (2 * model.hidden_size * dtype_bytes + model.vocab_size * (dtype_bytes + 4.0))
    mode = _mode(recompute)
    if mode == "full":
        return float(t * model.hidden_size * dtype_bytes) / cut
    logsumexp = micro_batch_size * model.num_heads * seq_len * 4.0 / tp
    if mode == "selective":
        return t * _selective_elements(model, tp, sequence_parallel) * dtype_bytes + logsumexp
    return t * _block_activation_elements(model, tp, sequence_parallel) * dtype_bytes + logsumexp


def layer_rerun_bytes(
    model: ModelSpec,
    layer_index: int,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    recompute: RecomputeMode = False,
    tp: int = 1,
    sequence_parallel: bool = False,
    full_bytes: float | None = None,
) -> float:
    """Bytes a recomputing block's backward holds again beyond what it kept: its rerun forward's
    saved activations (``full_bytes``: measured, else the formula's), less the kept tensors the rerun
    saves again (``full``: the input; ``selective``: the input, attention output and log-sum-exp and
    the MLP's gate and up). A selective block's kept outputs stay held until its backward ends
    (medley's runtime keeps them for a split backward's second rerun). 0 for other layers and
    ``none``."""
    mode = _mode(recompute)
    if mode == "none" or model.layer_kind(layer_index) != "block":
        return 0.0
    shape = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "dtype_bytes": dtype_bytes, "tp": tp,
             "sequence_parallel": sequence_parallel}
    full = layer_activation_bytes(model, layer_index, **shape) if full_bytes is None else full_bytes
    t = micro_batch_size * seq_len
    if mode == "full":
        kept = t * model.hidden_size * dtype_bytes / (tp if sequence_parallel else 1)
        return max(0.0, full - kept)
    logsumexp = micro_batch_size * model.num_heads * seq_len * 4.0 / tp
    return max(0.0, full - t * _overlap_elements(model, tp, sequence_parallel) * dtype_bytes - logsumexp)


def layer_activation_bytes_after_b(
    model: ModelSpec,
    layer_index: int,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    recompute: RecomputeMode = False,
    tp: int = 1,
) -> float:
    """Bytes still held between B and W: each weight matmul's input and its output gradient (per
    TP rank: the split matrices' split inputs and output gradients, the norms' outputs whole).

    A block's matmuls read four distinct tensors (attention-norm output, attention output, MLP-norm
    output, MLP inner product). The embedding's W is a scatter-add of its output gradient by token id.
    """
    del recompute  # recomputation happens before B, so W needs the same tensors either way
    t = micro_batch_size * seq_len
    gemms = layer_gemms(model, layer_index, micro_batch_size=micro_batch_size, seq_len=seq_len, tp=tp)
    output_grads = sum(g.tokens * g.out_features for g in gemms)
    kind = model.layer_kind(layer_index)
    if kind == "block":
        inputs = t * (2 * model.hidden_size + (model.hidden_size + model.ffn_hidden_size) / tp)
    else:
        inputs = sum(g.tokens * g.in_features for g in gemms)
    if kind == "embedding":
        return float((output_grads + inputs + t * model.embed_dim) * dtype_bytes + t * 8.0)
    return float((output_grads + inputs) * dtype_bytes)


def boundary_bytes(model: ModelSpec, *, micro_batch_size: int, seq_len: int, dtype_bytes: int = 2) -> float:
    """Bytes of the hidden states crossing a stage boundary (each way: activations F, gradients B)."""
    return float(micro_batch_size * seq_len * model.hidden_size * dtype_bytes)


def layer_elementwise_bytes(
    model: ModelSpec,
    layer_index: int,
    kind: Pass,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    tp: int = 1,
    vocab_parallel: bool = False,
) -> tuple[float, int]:
    """(bytes read + written, kernel count) of a pass's memory-bound, non-matmul work (per TP
    rank: RoPE and the MLP activation run on split tensors, norms and residual adds whole).

    Block F: two norms (read + write), two residual adds (2 reads + 1 write), RoPE on Q and K, the
    MLP activation. B roughly doubles F's traffic; W only reduces the norm weight gradients. Head:
    final norm and the cross-entropy over the logits (fp32 log-softmax; under ``vocab_parallel``
    over the rank's vocabulary slice). Embedding: gather / scatter-add.
    """
    t, h, d = micro_batch_size * seq_len, model.hidden_size, dtype_bytes
    layer_kind = model.layer_kind(layer_index)
    if layer_kind == "embedding":
        gather = 2.0 * t * model.embed_dim * d + (3.0 * t * h * d if model.position == "learned" else 0.0)
        return {Pass.F: (gather, 2), Pass.B: (0.0, 0), Pass.W: (1.5 * gather, 2)}[kind]
    if layer_kind == "head":
        loss = t * vocab_share(model, tp, vocab_parallel) * (d + 4.0)
        return {
            Pass.F: (loss + 2.0 * t * h * d, 3),
            Pass.B: (loss + 3.0 * t * h * d, 3),
            Pass.W: (2.0 * t * h * d, 1),
        }[kind]
    rope = 2.0 * (model.q_dim + model.kv_dim) if model.position == "rope" else 0.0
    activation = (3.0 if model.mlp == "swiglu" else 2.0) * model.ffn_hidden_size
    forward = t * d * (4.0 * h + 6.0 * h + (rope + activation) / tp)
    return {Pass.F: (forward, 6), Pass.B: (2.0 * forward, 12), Pass.W: (4.0 * t * h * d, 2)}[kind]
