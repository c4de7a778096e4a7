"""Per-layer figures the planner's estimates sum over a contiguous range of layers in O(1): a
:class:`LayerTable` of prefix sums per (device type, micro-batch size, sequence length, TP degree)
of each layer's F/B/W seconds (from the cost source), activation bytes under each recomputation
mode and held parameters, built by :func:`layer_table`. :mod:`medley.search.estimate.bounds` sizes stages and
steps from them."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import numpy as np

from medley.cost import formulas
from medley.cost.formulas import DTYPE_BYTES
from medley.cost.interfaces import CommModel, CostSource, Pass
from medley.cost.recompute import Recompute, parse_recompute
from medley.cost.tp_cost import TensorParallelCompute, tp_comm_time
from medley.plan.layout import planned_sequence_parallel
from medley.spec.adapter import LoraSpec
from medley.spec.model import ModelSpec


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    return (0.0, *accumulate(values))


def recompute_stop(i: int, j: int, recompute: Recompute) -> int:
    """The layer before which a stage of layers i..j-1 recomputes: j when all its blocks do, i when
    none, else past its first ``recompute.blocks`` blocks (layer 0 is the embedding)."""
    if not recompute:
        return i
    if recompute.blocks is None:
        return j
    return min(max(i, 1) + recompute.blocks, j)


@dataclass(frozen=True, kw_only=True)
class LayerTable:
    """Prefix sums over layers for one (device type, micro-batch size, sequence length).

    ``total[j] - total[i]`` is F+B+W of layers i..j-1 for one micro-batch; ``forward`` the F part
    (what recomputation adds); ``act``/``act_rc`` activation bytes held per in-flight micro-batch
    without/with recomputation; ``params`` parameters held (a tied head keeps its own copy);
    ``trained`` the parameters of ``params`` that train (a LoRA run's adapters, which ``params``
    counts beside the frozen base; else all of them);
    ``cast``/``cast_rc`` parameters autocast casts and the forward keeps the copies of
    (:func:`medley.cost.formulas.layer_autocast_params`; recomputing blocks keep none);
    ``dtype`` the training precision the activation bytes and the model-state bytes per parameter
    (:func:`medley.cost.zero_memory.state_bytes_per_param`) are counted in; ``tp`` the
    tensor-parallel degree the figures are one rank's of (times with the TP all-reduces).

    Finer recomputation (:mod:`medley.cost.recompute`, :meth:`time`, :func:`stage_memory`):
    ``act_sel`` the bytes a selective block keeps; ``rerun_rc``/``rerun_sel`` per layer the bytes
    a full/selective block's backward holds again
    (:func:`medley.cost.formulas.layer_rerun_bytes`); ``refwd``/``refwd_sel`` the blocks' forward
    seconds, all of it/its memory-bound share (what selective recomputation reruns: the catalog's
    roofline share, :meth:`medley.cost.estimator.CatalogCostSource.cheap_share`, of the source's
    forward time). Full recomputation of a whole stage adds ``forward`` (every layer's, as
    ``total_rc``); of its first k blocks, those blocks' ``refwd``.
    """

    device_type: str
    micro_batch_size: int
    dtype: str
    tp: int = 1
    total: tuple[float, ...]
    total_rc: tuple[float, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    act: tuple[float, ...]
    act_rc: tuple[float, ...]
    after_b: tuple[float, ...]
    params: tuple[float, ...]
    trained: tuple[float, ...]
    cast: tuple[float, ...]
    cast_rc: tuple[float, ...]
    act_sel: tuple[float, ...] = ()
    rerun_rc: tuple[float, ...] = ()
    rerun_sel: tuple[float, ...] = ()
    refwd: tuple[float, ...] = ()
    refwd_sel: tuple[float, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.total) - 1

    @cached_property
    def memory_columns(self) -> dict[str, np.ndarray]:
        """``params``, ``trained``, ``act``, ``act_rc``, ``act_sel``, ``cast``, ``cast_rc`` and ``after_b``
        as float64 arrays (for :func:`memory_prefix`)."""
        return {name: np.array(getattr(self, name), dtype=np.float64)
                for name in ("params", "trained", "act", "act_rc", "act_sel", "cast", "cast_rc", "after_b")}

    @cached_property
    def rerun_bytes(self) -> dict[tuple[int, int, Recompute], float]:
        """By (i, j, recomputation), the bytes a recomputing stage of layers i..j-1 holds again at
        its largest block's backward (:func:`stage_memory`'s term, kept as the planner asks for it)."""
        return {}

    def time(self, i: int, j: int, *, recompute: Recompute | bool = False) -> float:
        """F+B+W of layers i..j-1 for one micro-batch, with what ``recompute`` reruns."""
        rc = parse_recompute(recompute)
        if not rc:
            return self.total[j] - self.total[i]
        stop = recompute_stop(i, j, rc)
        if stop == j and rc.mode == "full":
            return self.total[j] - self.total[i] + self.forward[j] - self.forward[i]
        rerun = self.refwd if rc.mode == "full" else self.refwd_sel
        return self.total[j] - self.total[i] + rerun[stop] - rerun[i]

    def max_end(self, i: int, budget: float, *, recompute: Recompute | bool = False) -> int:
        """Largest j with time(i, j) <= budget (i when not even one layer fits)."""
        if not recompute:
            return bisect_right(self.total, self.total[i] + budget) - 1
        lo, hi = i, self.num_layers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.time(i, mid, recompute=recompute) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo


def layer_table(
    model: ModelSpec,
    cost: CostSource,
    *,
    device_type: str,
    micro_batch_size: int,
    seq_len: int,
    dtype: str,
    tensor: TensorParallelCompute,
    tp: int = 1,
    comm: CommModel | None = None,
    group: tuple[int, ...] = (),
    adapter: LoraSpec | None = None,
) -> LayerTable:
    """The table of one TP rank at ``tp`` (``tensor``, the search's
    :class:`~medley.cost.tp_cost.TensorPricing` of ``dtype``, prices its compute and its catalog the
    cheap share; the TP all-reduces run over ``group`` on ``comm``, as the compiler books them; tp 1
    needs neither), with sequence
    parallelism where the planner runs it (:func:`~medley.plan.layout.planned_sequence_parallel`;
    its stage edges' gathers are the compiler's to add). With ``adapter`` (LoRA) the layers hold
    their adapters too, only those train, and W keeps only their weight-gradient work
    (:func:`medley.cost.formulas.weight_grad_share`)."""
    shape = {"micro_batch_size": micro_batch_size, "seq_len": seq_len}
    sp = planned_sequence_parallel(seq_len, (tp,))
    if tp == 1:
        times = {
            p: [cost.layer_time(i, p, device_type=device_type, **shape).seconds
                for i in range(model.num_layers)]
            for p in Pass
        }
    else:
        times = {
            p: [
                tensor.layer_time(i, p, device_type=device_type, tp=tp, **shape)
                + tp_comm_time(comm, model, i, p, group=group, dtype=dtype, sequence_parallel=sp, **shape)
                for i in range(model.num_layers)
            ]
            for p in Pass
        }
    times[Pass.W] = [w * formulas.weight_grad_share(model, adapter, i, tp=tp)
                     for i, w in enumerate(times[Pass.W])]
    nbytes = DTYPE_BYTES[dtype]
    act = [
        formulas.layer_activation_bytes(model, i, dtype_bytes=nbytes, tp=tp, sequence_parallel=sp, **shape)
        for i in range(model.num_layers)
    ]
    act_rc = [
        formulas.layer_activation_bytes(model, i, dtype_bytes=nbytes, recompute=True, tp=tp,
                                        sequence_parallel=sp, **shape)
        for i in range(model.num_layers)
    ]
    after_b = [
        formulas.layer_activation_bytes_after_b(model, i, dtype_bytes=nbytes, tp=tp, **shape)
        for i in range(model.num_layers)
    ]
    total = [f + b + w for f, b, w in zip(times[Pass.F], times[Pass.B], times[Pass.W], strict=True)]
    cast = [formulas.layer_autocast_params(model, i, tp=tp, adapter=adapter) for i in range(model.num_layers)]
    catalog = tensor.catalog
    blocks = [model.layer_kind(i) == "block" for i in range(model.num_layers)]
    refwd = [f if block else 0.0 for f, block in zip(times[Pass.F], blocks, strict=True)]
    share = catalog.cheap_share(1, device_type=device_type, tp=tp, **shape) if model.num_blocks else 0.0
    sized = {"dtype_bytes": nbytes, "tp": tp, "sequence_parallel": sp, **shape}
    return LayerTable(
        device_type=device_type,
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        tp=tp,
        total=_prefix(total),
        total_rc=_prefix([t + f for t, f in zip(total, times[Pass.F], strict=True)]),
        forward=_prefix(times[Pass.F]),
        backward=_prefix(times[Pass.B]),
        weight=_prefix(times[Pass.W]),
        act=_prefix(act),
        act_rc=_prefix(act_rc),
        after_b=_prefix([min(a, b) for a, b in zip(after_b, act, strict=True)]),
        params=_prefix([float(formulas.layer_held_params(model, i, tp=tp))
                        + formulas.layer_adapter_params(model, adapter, i, tp=tp)
                        for i in range(model.num_layers)]),
        trained=_prefix([float(formulas.layer_held_params(model, i, tp=tp)) if adapter is None
                         else formulas.layer_adapter_params(model, adapter, i, tp=tp)
                         for i in range(model.num_layers)]),
        cast=_prefix(cast),
        cast_rc=_prefix([formulas.layer_autocast_params(model, i, tp=tp, recompute=True, adapter=adapter)
                         for i in range(model.num_layers)]),
        act_sel=_prefix([formulas.layer_activation_bytes(model, i, recompute="selective", **sized)
                         for i in range(model.num_layers)]),
        rerun_rc=tuple(formulas.layer_rerun_bytes(model, i, recompute="full", **sized)
                       for i in range(model.num_layers)),
        rerun_sel=tuple(formulas.layer_rerun_bytes(model, i, recompute="selective", **sized)
                        for i in range(model.num_layers)),
        refwd=_prefix(refwd),
        refwd_sel=_prefix([f * share for f in refwd]),
    )
