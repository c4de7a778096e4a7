"""Per-layer time estimates from the device catalog (a :class:`CostSource`).

Each matmul is timed with a roofline, max(FLOPs / (peak x efficiency), bytes / memory bandwidth,
minimum kernel time); the efficiency grows with the matrix sizes:

    efficiency(m, n, k) = E_MAX * (m*n / (m*n + MN_HALF)) * (k / (k + K_HALF))

where E_MAX is the device type's ``matmul_efficiency`` (``attention_efficiency`` for the attention
kernel) and the minimum kernel time its ``kernel_overhead_us``: catalog data, calibrated against
published runs where the catalog says so (src/medley/spec/devices.toml, bench/published.py).

The m*n factor stands for wave quantisation and too few output tiles to fill the SMs, the k factor
for the fixed cost of loading and storing each output tile against a short reduction (NVIDIA,
"Matrix Multiplication Background User's Guide", DU-09799-001, 2023). Attention's core is timed
as a batch of (seq x seq x head_dim) matmuls with the same formula over the causal tiles only, as
flash attention computes it; non-matmul work (norms, RoPE, activations, residual adds, the loss)
is memory-bound: bytes / (bandwidth x the type's ``memory_efficiency``).
docs/cost-model.md gives the constants' reasoning. Measured profiles replace these estimates.
"""

from __future__ import annotations

from collections.abc import Mapping

from medley.cost import formulas
from medley.cost.formulas import DTYPE_BYTES
from medley.cost.interfaces import MeasuresNothing, Pass, TimeEstimate
from medley.errors import MedleyInputError
from medley.spec.catalog import DEFAULT_MATMUL_EFFICIENCY, DeviceType, get_device_type, load_catalog
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec

E_MAX = DEFAULT_MATMUL_EFFICIENCY  # the ceiling of a type the catalog has not calibrated
MN_HALF = 128 * 128 * 8  # output elements at which the size factor is one half (8 tiles of 128x128)
K_HALF = 64  # reduction length at which the k factor is one half
BLOCK = 128  # the query/key tile of flash attention: a causal mask skips the tiles above the diagonal
ATTENTION_MATMULS = {Pass.F: 2, Pass.B: 5, Pass.W: 0}
"""(seq x seq x head_dim) matmuls flash attention runs per pass (FlashAttention-2, Dao 2023: the
backward recomputes the scores, then computes dV, dP, dQ and dK)."""


def matmul_efficiency(m: float, n: float, k: float, *, ceiling: float = E_MAX) -> float:
    """Fraction of dense peak a matmul of (m x k) by (k x n) reaches when compute-bound, below
    ``ceiling`` (the device type's :attr:`DeviceType.matmul_efficiency`)."""
    return ceiling * (m * n / (m * n + MN_HALF)) * (k / (k + K_HALF))


def kernel_floor(device: DeviceType) -> float:
    """The least time one kernel takes on ``device`` with its launch, seconds."""
    return device.kernel_overhead_us * 1e-6


def matmul_time(device: DeviceType, m: float, n: float, k: float, *, dtype: str, batch: float = 1.0,
                ceiling: float | None = None, work: float = 1.0) -> float:
    """Roofline time of ``batch`` independent (m x k)(k x n) matmuls run as one kernel, of which
    the kernel computes the share ``work`` (a causal mask's tiles); ``ceiling``: the efficiency
    ceiling (default the device type's matmul efficiency)."""
    d = DTYPE_BYTES[dtype]
    top = device.matmul_efficiency if ceiling is None else ceiling
    flops = work * batch * 2.0 * m * n * k
    compute = flops / (device.peak_flops(dtype) * matmul_efficiency(batch * m, n, k, ceiling=top))
    memory = batch * d * (m * k + k * n + m * n) / (device.memory_bandwidth_gbps * 1e9)
    return max(compute, memory, kernel_floor(device))


def causal_share(seq_len: int) -> float:
    """Share of the seq x seq score square that causal flash attention computes: the tiles of
    :data:`BLOCK` on and below the diagonal, (n + 1) / (2n) of n x n tiles (a sliding window is
    costed as full causal attention)."""
    tiles = max(1, -(-seq_len // BLOCK))
    return (tiles + 1) / (2 * tiles)


class CatalogCostSource(MeasuresNothing):
    """Answers layer times from catalog peaks. Blocks are identical, so results are cached per
    (layer kind, pass, micro-batch size, sequence length, device type)."""

    def __init__(
        self, model: ModelSpec, *, dtype: str = "bf16", catalog: Mapping[str, DeviceType] | None = None,
        vocab_parallel: bool = False,
    ) -> None:
        """``vocab_parallel``: a TP stage's head and cross-entropy split over the vocabulary, as
        Megatron-LM runs them (:func:`medley.cost.formulas.vocab_share`); medley's runtime
        replicates the head on every TP rank, so its plans are costed without."""
        if dtype not in DTYPE_BYTES:
            raise MedleyInputError(f"dtype '{dtype}' is not supported; use one of {', '.join(DTYPE_BYTES)}.")
        self.model = model
        self.dtype = dtype
        self.vocab_parallel = vocab_parallel
        self.catalog = dict(load_catalog() if catalog is None else catalog)
        self._cache: dict[tuple[str, Pass, int, int, str, int], TimeEstimate] = {}

    @classmethod
    def for_cluster(cls, model: ModelSpec, cluster: Cluster, *, dtype: str = "bf16",
                    vocab_parallel: bool = False) -> CatalogCostSource:
        """A source that also knows the cluster's override-renamed device types (``A100-80GB@node``)."""
        return cls(model, dtype=dtype, catalog={**load_catalog(), **cluster.device_types()},
                   vocab_parallel=vocab_parallel)

    def layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int = 1
    ) -> TimeEstimate:
        """Compute time of one pass of ``layer``; with ``tp`` > 1 that of one tensor-parallel rank
        running its share of a block (:func:`medley.cost.formulas.layer_gemms`), without the TP
        all-reduces (:mod:`medley.cost.tp_cost` adds those)."""
        key = (self.model.layer_kind(layer), Pass(kind), micro_batch_size, seq_len, device_type, tp)
        cached = self._cache.get(key)
        if cached is None:
            device = get_device_type(device_type, self.catalog)
            seconds = self._compute(layer, Pass(kind), micro_batch_size, seq_len, device, tp)
            cached = self._cache[key] = TimeEstimate(seconds=seconds, source="catalog")
        return cached

    def cheap_share(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int = 1
    ) -> float:
        """The share of a block's forward that is memory-bound work (norms, RoPE, the MLP
        activation, residual adds; no matmul, no attention kernel) under this roofline: what a
        selectively recomputing block reruns (:mod:`medley.cost.recompute`). 0 for other layers.
        A device type the catalog does not know (a profile's) is priced as the catalog's
        A100-80GB, an estimate."""
        if self.model.layer_kind(layer) != "block":
            return 0.0
        if device_type not in self.catalog:
            device_type = "A100-80GB"
        total = self.layer_time(layer, Pass.F, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                device_type=device_type, tp=tp).seconds
        device = get_device_type(device_type, self.catalog)
        nbytes, kernels = formulas.layer_elementwise_bytes(
            self.model, layer, Pass.F, micro_batch_size=micro_batch_size, seq_len=seq_len,
            dtype_bytes=DTYPE_BYTES[self.dtype], tp=tp)
        cheap = max(nbytes / (device.memory_bandwidth_gbps * 1e9 * device.memory_efficiency),
                    kernels * kernel_floor(device))
        return cheap / total if total > 0 else 0.0

    def _compute(self, layer: int, kind: Pass, mbs: int, seq: int, device: DeviceType, tp: int = 1) -> float:
        model, dtype = self.model, self.dtype
        seconds = 0.0
        split = {"tp": tp, "vocab_parallel": self.vocab_parallel}
        for gemm in formulas.layer_gemms(model, layer, micro_batch_size=mbs, seq_len=seq, **split):
            m, n, k = gemm.shape(kind)
            seconds += matmul_time(device, m, n, k, dtype=dtype)
        if model.layer_kind(layer) == "block" and kind is not Pass.W:
            # Flash attention per (batch, head): F runs two matmuls (scores, AV) over the causal
            # tiles; B five (the scores again, then dV, dP, dQ and dK).
            heads = mbs * model.num_heads // tp
            one = matmul_time(device, seq, seq, model.head_dim, dtype=dtype, batch=heads,
                              ceiling=device.attention_efficiency, work=causal_share(seq))
            seconds += one * ATTENTION_MATMULS[kind]
        nbytes, kernels = formulas.layer_elementwise_bytes(
            model, layer, kind, micro_batch_size=mbs, seq_len=seq, dtype_bytes=DTYPE_BYTES[dtype], **split
        )
        bandwidth = device.memory_bandwidth_gbps * 1e9 * device.memory_efficiency
        seconds += max(nbytes / bandwidth, kernels * kernel_floor(device))
        return seconds


def stage_time(
    source: CatalogCostSource,
    layers: range,
    kind: Pass,
    *,
    micro_batch_size: int,
    seq_len: int,
    device_type: str,
) -> float:
    """Seconds of one pass over a contiguous range of layers for one micro-batch."""
    return sum(
        source.layer_time(
            i, kind, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        ).seconds
        for i in layers
    )
