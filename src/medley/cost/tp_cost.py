"""What tensor parallelism costs per layer: one TP rank's compute and the TP all-reduces.

One definition, read by the compiler (:mod:`medley.lowering.compile`) and the planner's analytic
tables (:mod:`medley.search.estimate.bounds`), for Megatron-style TP of every transformer block over a group
of ``tp`` devices on one node (norms, embedding and head replicated, as medley's runtime runs them;
a catalog source made ``vocab_parallel`` splits the head and its cross-entropy over the vocabulary
as Megatron-LM does, timed from the split shapes as a block is, its small all-reduces untimed):

* **Compute.** A rank runs the block's matmuls on its 1/tp share (Q/K/V and gate/up split by
  output columns, the attention output and down projections by input rows), attention over
  heads/tp, and RoPE and the MLP activation on split tensors; norms and residual adds stay whole.
  Smaller matmuls reach a smaller fraction of the device's peak, which the catalog's roofline
  (:mod:`medley.cost.estimator`: efficiency falling with m·n and k, a minimum kernel time, the
  memory-bound limit) prices from the split shapes. A block's time at ``tp`` is the source's own
  time at tp=1 (measured, where a profile has it) times the roofline's ratio
  ``time(tp) / time(1)`` for that pass on that device type: a catalog source thus gets its
  roofline of the split shapes exactly, a profile its measurement scaled by how much the
  split shapes lose. Device types the catalog does not know scale by ``1/tp`` (perfect split).
  A source that measured the block at ``tp`` itself (``tp_layer_time``: Metis-format files of
  that degree, :mod:`medley.cost.metis`) answers instead, and its ratio to its own tp=1 time
  replaces the roofline's.
* **Communication.** Each block all-reduces its output activation (micro_batch x seq x hidden in
  the training dtype) over the TP group twice in F (after attention and after the MLP) and its
  input gradient twice in B (the column-parallel layers' input gradients); W (the weight
  gradients of zero-bubble schedules) has none, and a recomputing block's rerun forward repeats
  F's two. The all-reduces are synchronous in the compute stream, so their time is part of the
  compute action's (:func:`tp_comm_time`), timed by the cluster's α-β model on the group.
* **Sequence parallelism** (``sequence_parallel``, :mod:`medley.runtime.tensor_parallel`): each
  all-reduce becomes an all-gather (of the sub-layer's input) and a reduce-scatter (of its
  output), in F and again in B (:data:`SP_COLLECTIVES`): on a ring the same bytes in two passes
  as the all-reduce's two, each with its own latency. A stage's edges add one all-gather of the
  hidden states where a whole tensor meets the shards (:func:`sequence_edge_time`): the output in
  F unless it crosses to the next stage as shards, the input's gradient in B unless the input came
  as shards. The norms' weight gradients, summed over the group once per step (2 x hidden values
  per block), are not timed. Activations: the block input and the MLP-norm input are held 1/tp
  (:func:`medley.cost.formulas.layer_activation_bytes`).
"""

from __future__ import annotations

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.formulas import DTYPE_BYTES
from medley.cost.interfaces import Collective, CommModel, CostSource, Pass
from medley.errors import MedleyInputError
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec

TP_ALL_REDUCES = {Pass.F: 2, Pass.B: 2, Pass.W: 0}
"""All-reduces of one block per pass over its TP group (Megatron, no sequence parallelism)."""
SP_COLLECTIVES = {Pass.F: {Collective.ALL_GATHER: 2, Collective.REDUCE_SCATTER: 2},
                  Pass.B: {Collective.ALL_GATHER: 2, Collective.REDUCE_SCATTER: 2}, Pass.W: {}}
"""Collectives of one block per pass over its TP group under sequence parallelism, each of the
whole hidden-state tensor (:func:`tp_all_reduce_bytes`)."""


def tp_collectives(kind: Pass, *, sequence_parallel: bool = False) -> dict[Collective, int]:
    """The collectives (and how many) one block issues in pass ``kind`` over its TP group."""
    if sequence_parallel:
        return dict(SP_COLLECTIVES[Pass(kind)])
    count = TP_ALL_REDUCES[Pass(kind)]
    return {Collective.ALL_REDUCE: count} if count else {}


def tp_all_reduce_bytes(model: ModelSpec, *, micro_batch_size: int, seq_len: int, dtype: str) -> float:
    """Bytes of each TP all-reduce of a block: the whole hidden-state tensor of the micro-batch."""
    return formulas.boundary_bytes(model, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                   dtype_bytes=DTYPE_BYTES[dtype])


def tp_comm_time(
    comm: CommModel | None,
    model: ModelSpec,
    layer: int,
    kind: Pass,
    *,
    group: tuple[int, ...],
    micro_batch_size: int,
    seq_len: int,
    dtype: str,
    sequence_parallel: bool = False,
) -> float:
    """Seconds of one pass's TP collectives of ``layer`` over the devices of ``group`` (0 for a
    group of one, a replicated layer or W): all-reduces, or under ``sequence_parallel``
    all-gathers and reduce-scatters (:func:`tp_collectives`)."""
    if comm is None or len(group) < 2 or model.layer_kind(layer) != "block":
        return 0.0
    nbytes = tp_all_reduce_bytes(model, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype)
    return sum(n * comm.collective_time(op, group, nbytes)
               for op, n in tp_collectives(kind, sequence_parallel=sequence_parallel).items())


def sequence_edge_collectives(kind: Pass, *, whole_input: bool, whole_output: bool) -> int:
    """All-gathers of the hidden states a sequence-parallel stage's edges add to pass ``kind``: F
    gathers a whole output from the last block's shards, B the whole gradient of a whole input
    (the first block cut it to its shard)."""
    return int(whole_output) if kind is Pass.F else int(whole_input) if kind is Pass.B else 0


def sequence_edge_time(comm: CommModel | None, group: tuple[int, ...], nbytes: float, kind: Pass, *,
                       whole_input: bool, whole_output: bool) -> float:
    """Seconds of :func:`sequence_edge_collectives` of ``nbytes`` (the whole hidden states) each."""
    count = sequence_edge_collectives(kind, whole_input=whole_input, whole_output=whole_output)
    if comm is None or len(group) < 2 or not count:
        return 0.0
    return count * comm.collective_time(Collective.ALL_GATHER, group, nbytes)


class TensorParallelCompute:
    """One TP rank's compute time of a layer from any :class:`CostSource` (the module docstring).

    ``catalog`` prices the split shapes (it must know the cluster's device types, e.g.
    :meth:`CatalogCostSource.for_cluster`); ratios are cached per (pass, micro-batch size,
    sequence length, device type, degree)."""

    def __init__(self, model: ModelSpec, cost: CostSource, *, catalog: CatalogCostSource) -> None:
        self.model, self.cost, self.catalog = model, cost, catalog
        self._ratios: dict[tuple[Pass, int, int, str, int], float] = {}

    def measured(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int
    ) -> float | None:
        """The source's own time of one pass of block ``layer`` on one of ``tp`` ranks, if it has one."""
        found = self.cost.tp_layer_time(layer, kind, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                        device_type=device_type, tp=tp)
        return None if found is None else found.seconds

    def scale(self, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int,
              layer: int = 1) -> float:
        """A block's compute time at ``tp`` over its time at 1, for one pass (1 at tp=1); with
        ``layer`` the head's, under a vocabulary-parallel catalog (1 where the head is replicated)."""
        head = self.model.layer_kind(layer) == "head"
        if tp == 1 or (head and not self.catalog.vocab_parallel):
            return 1.0
        key = (Pass(kind), micro_batch_size, seq_len, device_type, tp, head)
        ratio = self._ratios.get(key)
        if ratio is None:
            block = layer if head else 1  # every block has the same shapes
            at = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "device_type": device_type}
            split = None if head else self.measured(block, kind, tp=tp, **at)
            if split is not None:
                whole = self.cost.layer_time(block, kind, **at).seconds
                ratio = self._ratios[key] = split / whole if whole > 0 else 1.0 / tp
                return ratio
            try:
                whole = self.catalog.layer_time(block, kind, micro_batch_size=micro_batch_size,
                                                seq_len=seq_len, device_type=device_type).seconds
                split = self.catalog.layer_time(block, kind, micro_batch_size=micro_batch_size,
                                                seq_len=seq_len, device_type=device_type, tp=tp).seconds
                ratio = split / whole if whole > 0 else 1.0 / tp
            except MedleyInputError:  # a profile's device type the catalog does not know
                ratio = 1.0 / tp
            self._ratios[key] = ratio
        return ratio

    def layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int
    ) -> float:
        """Seconds of one pass of ``layer`` on one of ``tp`` ranks, communication excluded."""
        at = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "device_type": device_type}
        if tp > 1 and self.model.layer_kind(layer) == "block":
            split = self.measured(layer, kind, tp=tp, **at)
            if split is not None:
                return split
            return self.cost.layer_time(layer, kind, **at).seconds * self.scale(kind, tp=tp, **at)
        whole = self.cost.layer_time(layer, kind, **at).seconds
        if self.model.layer_kind(layer) == "head":  # split only under a vocabulary-parallel catalog
            return whole * self.scale(kind, tp=tp, layer=layer, **at)
        return whole


def tp_activation_bytes(
    model: ModelSpec, layer: int, measured: tuple[float, float], *, micro_batch_size: int, seq_len: int,
    dtype: str, tp: int, sequence_parallel: bool = False,
) -> tuple[float, float]:
    """One TP rank's (F-to-B, B-to-W) activation bytes of ``layer`` from a profile's ``measured``
    ones (taken at tp=1): less the bytes the formulas' split tensors save at ``tp``. What the
    measurement holds beyond the formulas' tensors (temporaries, the block's output) is whole on
    every rank, so scaling the whole measurement by the formulas' ratio would count it split too
    (tiny on CPU: 2.7% under per block at tp 2). Under ``sequence_parallel`` the norms'
    normalised inputs, which a measurement holds (:data:`NORM_SAVED`) and the formulas do not
    count, are sequence shards too."""
    if tp == 1 or model.layer_kind(layer) != "block":
        return measured
    d = DTYPE_BYTES[dtype]
    kw = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "dtype_bytes": d}
    norms = NORM_SAVED * micro_batch_size * seq_len * model.hidden_size * d * (1 - 1 / tp)
    saved = (formulas.layer_activation_bytes(model, layer, **kw)
             - formulas.layer_activation_bytes(model, layer, tp=tp, sequence_parallel=sequence_parallel, **kw)
             + (norms if sequence_parallel else 0.0),
             formulas.layer_activation_bytes_after_b(model, layer, **kw)
             - formulas.layer_activation_bytes_after_b(model, layer, tp=tp, **kw))
    return (max(measured[0] - saved[0], measured[0] / tp), max(measured[1] - saved[1], measured[1] / tp))


NORM_SAVED = 2
"""Hidden-size tensors per block a norm's autograd keeps beyond the formulas' count: each of the
two norms its normalised input (for its weight's gradient). Counted on CPU
(tests/runtime/test_tp_activation_census.py): whole without sequence parallelism, shards with it."""


def activation_scale(
    model: ModelSpec, layer: int, *, micro_batch_size: int, seq_len: int, dtype: str, tp: int,
    sequence_parallel: bool = False,
) -> tuple[float, float]:
    """(F-to-B, B-to-W) activation bytes of ``layer`` at ``tp`` over those at 1, by the formulas:
    how a profile's measured activation bytes (taken at tp=1) scale to one TP rank."""
    if tp == 1 or model.layer_kind(layer) != "block":
        return 1.0, 1.0
    d = DTYPE_BYTES[dtype]
    kw = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "dtype_bytes": d}
    full = formulas.layer_activation_bytes(model, layer, **kw)
    after = formulas.layer_activation_bytes_after_b(model, layer, **kw)
    return (formulas.layer_activation_bytes(model, layer, tp=tp, sequence_parallel=sequence_parallel, **kw)
            / full,
            formulas.layer_activation_bytes_after_b(model, layer, tp=tp, **kw) / after)


class TensorPricing:
    """One :class:`TensorParallelCompute` per dtype over ``cost`` on ``cluster``, made once by
    whoever prices that cluster (a search's context, shared by its tables and every simulation it
    runs; one command's simulation) so that their ratio caches serve all of them. Split shapes are
    priced by the source itself where it is the catalog of that dtype, else by the catalog of the
    cluster's device types."""

    def __init__(self, model: ModelSpec, cost: CostSource, cluster: Cluster) -> None:
        self.model, self.cost, self.cluster = model, cost, cluster
        self._by_dtype: dict[str, TensorParallelCompute] = {}

    def of(self, dtype: str) -> TensorParallelCompute:
        found = self._by_dtype.get(dtype)
        if found is None:
            if isinstance(self.cost, CatalogCostSource) and self.cost.dtype == dtype:
                catalog = self.cost
            else:
                catalog = CatalogCostSource.for_cluster(self.model, self.cluster, dtype=dtype)
            found = self._by_dtype[dtype] = TensorParallelCompute(self.model, self.cost, catalog=catalog)
        return found
