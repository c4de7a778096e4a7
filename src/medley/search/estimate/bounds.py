"""Fast analytic estimates the planner prunes with; the exact simulation has the last word.

The per-layer figures come from :class:`~medley.search.estimate.layer_table.LayerTable`, prefix sums of each
layer's F/B/W seconds, activation bytes and held parameters.

* :func:`stage_memory`: a stage's peak bytes per device under a ZeRO option, the same terms the
  compiler hands the simulator (model state by :mod:`medley.cost.zero_memory`, with the gradient
  and ZeRO-3's gathered weights, in-flight activations).
* :func:`pipeline_time`: 1F1B-style step estimate per replica, (m-1)·t_max + Σ t_s, with HARP's
  link term max(t, transfer), 1F1B's in-flight limit (:func:`round_trip_cycle`) and the family's
  bubble shape.
* :func:`aggregate_bound`: the most the cluster could do (no bubbles, no communication).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from medley.cost import formulas
from medley.cost.interfaces import CostSource, Pass, ProfileRangeError
from medley.cost.recompute import FULL, Recompute
from medley.cost.zero_memory import (
    autocast_copy_bytes,
    frozen_state_bytes,
    stage_state_bytes,
    state_bytes_per_param,
)
from medley.schedule.generators.classic import one_f_one_b_depth
from medley.schedule.zero import split_evenly
from medley.search.estimate.layer_table import LayerTable, recompute_stop
from medley.search.space import MemoryOption, memory_option
from medley.spec.adapter import LoraSpec
from medley.spec.cluster import Cluster
from medley.spec.model import ModelSpec


def memory_options(dp: int, *, replicated_level: int = 0) -> tuple[MemoryOption, ...]:
    """Least memory-saving first: plain state; when replicated, ZeRO-1, streamed ZeRO-3, then
    recomputation with ZeRO-1 or streamed ZeRO-3. Plain state and ZeRO-1 trade differently (ZeRO-1
    steps only a shard but gathers the updated weights after the step, which nothing hides):
    ``replicated_level`` 1 starts the ladder at ZeRO-1, for a builder to try both."""
    if dp == 1:
        return (memory_option(0), memory_option(0, recompute=FULL))
    plain = (memory_option(0),) if replicated_level == 0 else ()
    return (
        *plain,
        memory_option(1),
        memory_option(3, buckets=8),
        memory_option(1, recompute=FULL),
        memory_option(3, buckets=8, recompute=FULL),
    )


@cache  # a pure function of a few small values, asked millions of times by the split sweep
def option_bytes_per_param(option: MemoryOption, dp: int, *, dtype: str, layers: int | None = None,
                           frozen: bool = False) -> float:
    """Peak model-state bytes per parameter per device in ``dtype``: the memory model the compiler
    books (:func:`medley.cost.zero_memory.stage_state_bytes`) with its transients (the gradient
    autograd makes, its shard, one bucket's reduction buffer, ZeRO-3's gathered weights: the whole
    stage for each compute action, streamed or not) all held at once, for a stage of ``layers``
    layers (default: at least ``option.buckets``) in ``option.buckets`` even buckets; ``frozen``: a
    frozen parameter's (a LoRA run's base, :func:`medley.cost.zero_memory.frozen_state_bytes`)."""
    buckets = option.buckets if layers is None else min(option.buckets, max(1, layers))
    largest = 1.0 / buckets if layers is None else max(split_evenly(max(1, layers), buckets)) / max(1, layers)
    per_param = state_bytes_per_param(dtype)
    if frozen:
        return frozen_state_bytes(1.0, level=option.level, dp=dp, per_param=per_param).peak
    return stage_state_bytes(1.0, level=option.level, dp=dp, per_param=per_param,
                             bucket_fraction=largest).peak


@dataclass(frozen=True, kw_only=True, slots=True)
class Flight:
    """Micro-batches a stage holds at its peak: ``full`` between F and B, ``after_b`` between B
    and a deferred W (zero-bubble schedules)."""

    full: float
    after_b: float = 0.0


def stage_memory(
    table: LayerTable, i: int, j: int, *, option: MemoryOption, dp: int, in_flight: float | Flight
) -> float:
    """Estimated peak bytes per device of a stage holding layers i..j-1."""
    flight = in_flight if isinstance(in_flight, Flight) else Flight(full=in_flight)
    params = table.params[j] - table.params[i]
    trained = table.trained[j] - table.trained[i]
    rc = option.recompute
    stop = recompute_stop(i, j, rc)
    acts = _kept(table, rc)
    casts = table.cast_rc if rc else table.cast
    # Layers i..stop-1 under the option's mode, stop..j-1 keeping everything.
    cast = casts[stop] - casts[i] + table.cast[j] - table.cast[stop]
    copies = _copy_bytes(option, dp, table.dtype) * cast  # held until W, if split
    act = acts[stop] - acts[i] + table.act[j] - table.act[stop] + copies
    state = trained * option_bytes_per_param(option, dp, dtype=table.dtype, layers=j - i)
    if params > trained:  # a frozen base (LoRA)
        state += (params - trained) * option_bytes_per_param(option, dp, dtype=table.dtype, layers=j - i,
                                                             frozen=True)
    rerun = 0.0
    if rc:
        reruns = table.rerun_bytes
        rerun = reruns.get((i, j, rc))
        if rerun is None:
            rerun = reruns[(i, j, rc)] = _rerun_bytes(table, i, j, rc)
    return state + flight.full * act + flight.after_b * (table.after_b[j] - table.after_b[i] + copies) + rerun


def _kept(table: LayerTable, recompute: Recompute) -> tuple[float, ...]:
    if not recompute:
        return table.act
    return table.act_rc if recompute.mode == "full" else table.act_sel


def _rerun_bytes(table: LayerTable, i: int, j: int, recompute: Recompute) -> float:
    """A recomputing block holds its forward's activations again during its backward (as the
    compiler books, lowering.compile.backward_workspace): the largest recomputing block's of layers
    i..j-1, once, less what the layers after it freed when their backward ran first (at least what
    a split B frees)."""
    stop = recompute_stop(i, j, recompute)
    kept, after_b = _kept(table, recompute), table.after_b
    again = table.rerun_rc if recompute.mode == "full" else table.rerun_sel
    rerun = gone = 0.0
    for k in range(j - 1, i - 1, -1):
        mine = k < stop
        held = kept[k + 1] - kept[k] if mine else table.act[k + 1] - table.act[k]
        if mine:
            rerun = max(rerun, again[k] - gone)
        gone += max(0.0, held - (after_b[k + 1] - after_b[k]))
    return rerun


def memory_prefix(table: LayerTable, *, option: MemoryOption, dp: int, flight: Flight) -> np.ndarray:
    """c[j] with c[j] - c[i] = :func:`stage_memory` for stages of at least ``option.buckets`` layers
    (shorter stages reduce in larger buckets, and recomputing stages hold one block's activations
    more: check them exactly), as a float64 array."""
    if option.recompute.blocks is not None:
        raise ValueError(f"memory_prefix: recomputation {option.recompute} of the first blocks is not a "
                         "prefix sum; size such stages with stage_memory")
    a = option_bytes_per_param(option, dp, dtype=table.dtype)
    a_frozen = option_bytes_per_param(option, dp, dtype=table.dtype, frozen=True)
    c = _copy_bytes(option, dp, table.dtype)
    columns = table.memory_columns
    rc = option.recompute
    acts = columns["act"] if not rc else columns["act_rc" if rc.mode == "full" else "act_sel"]
    casts = columns["cast_rc"] if rc else columns["cast"]
    # Element by element in float64, in the order written: a * p + full * (x + c * k)
    # + after_b * (y + c * k); a frozen base (LoRA: t of the p train) a_f * (p - t) + a * t.
    params, trained = columns["params"], columns["trained"]
    state = a * params if params[-1] == trained[-1] else a_frozen * (params - trained) + a * trained
    return (state + flight.full * (acts + c * casts)
            + flight.after_b * (columns["after_b"] + c * casts))


@cache  # a pure function of three small values, asked for every stage the sweeps and rules size
def _copy_bytes(option: MemoryOption, dp: int, dtype: str) -> float:
    """Autocast's weight-copy bytes per cast parameter per micro-batch in flight."""
    return autocast_copy_bytes(level=option.level, dp=dp, per_param=state_bytes_per_param(dtype))


def pipeline_time(
    family: str,
    *,
    stage_times: Sequence[float],
    stage_weight_times: Sequence[float],
    link_times: Sequence[float],
    micro_batches: int,
    virtual_stages: int = 1,
    link_load: float = 0.0,
) -> float:
    """Estimated compute+transfer time of one replica's step (no DP collectives).

    ``stage_times[s]``: F+B+W of one micro-batch on stage s (rank order); ``link_times[k]``: one
    boundary transfer between ranks k and k+1. The bottleneck is max(stage, link) as in HARP,
    and at least ``link_load``: the seconds per micro-batch the busiest shared link (a node's
    network port, which every replica's and TP rank's transfers leaving the node cross) carries.
    1F1B and ZB-H1 (which keeps 1F1B's in-flight micro-batches) are held to
    :func:`round_trip_cycle` too; hetero-1f1b deepens its warm-up before slow links for that reason.
    """
    bottleneck = max(max(stage_times), max(link_times, default=0.0), link_load)
    if family in ("1f1b", "zb-h1"):
        bottleneck = max(bottleneck, round_trip_cycle(stage_times, link_times, micro_batches))
    fill = sum(stage_times) + 2.0 * sum(link_times)
    m = micro_batches
    if family == "zb-h1":
        # Deferred weight gradients fill the cooldown: about (p-1)(F+B-W) of bubble instead of (p-1)(F+B+W).
        worst = max(range(len(stage_times)), key=lambda s: stage_times[s])
        saved = 2.0 * stage_weight_times[worst] * (len(stage_times) - 1)
        return max(m * bottleneck, (m - 1) * bottleneck + fill - saved)
    if family == "interleaved":
        return (m - 1) * bottleneck + fill / virtual_stages + 2.0 * sum(link_times) * (virtual_stages - 1)
    return (m - 1) * bottleneck + fill


def round_trip_cycle(stage_times: Sequence[float], link_times: Sequence[float], micro_batches: int) -> float:
    """The least steady-state time per micro-batch that 1F1B's in-flight limit allows: rank k keeps
    pp-k micro-batches in flight, and each must go down the rest of the pipeline and back (the
    later ranks' compute, each boundary's transfer both ways; a missing link time counts as 0)
    before rank k runs its backward and takes the next one in; so a cycle takes at least that loop
    over the micro-batches sharing it. A rank that holds all ``micro_batches`` at once never waits
    on the limit. Without transfers this is at most the slowest stage's time; a slow boundary near
    the end of the pipeline, which few micro-batches share, stretches every cycle. ``stage_times``
    are F+B+W (ZB-H1's deferred W is counted in the loop too: an upper estimate there)."""
    pp = len(stage_times)
    worst = below = links = 0.0
    for k in range(pp - 1, -1, -1):
        if k < pp - 1 and k < len(link_times):
            links += link_times[k]
        depth = one_f_one_b_depth(pp, k, micro_batches)
        if depth < micro_batches:
            worst = max(worst, (stage_times[k] + below + 2.0 * links) / depth)
        below += stage_times[k]
    return worst


def best_standalone_tokens_per_s(
    model: ModelSpec, cost: CostSource, *, device_type: str, seq_len: int, micro_batch_sizes: Sequence[int],
    adapter: LoraSpec | None = None,
) -> tuple[float, int]:
    """A device's tokens/s running the whole model alone at its best micro-batch (no bubbles, no
    communication, memory ignored), and that micro-batch size; with ``adapter`` (LoRA) W keeps only
    the adapters' weight gradients (:func:`medley.cost.formulas.weight_grad_share`)."""
    best = (0.0, micro_batch_sizes[0])
    for mbs in micro_batch_sizes:
        try:
            seconds = sum(
                cost.layer_time(i, p, micro_batch_size=mbs, seq_len=seq_len, device_type=device_type).seconds
                * (formulas.weight_grad_share(model, adapter, i) if p is Pass.W else 1.0)
                for i in range(model.num_layers)
                for p in Pass
            )
        except ProfileRangeError:  # a measured profile without this size
            continue
        best = max(best, (mbs * seq_len / seconds, mbs))
    return best


def aggregate_bound(
    cluster: Cluster,
    model: ModelSpec,
    cost: CostSource,
    *,
    seq_len: int,
    micro_batch_sizes: Sequence[int],
    devices: Sequence[int] | None = None,
    adapter: LoraSpec | None = None,
) -> float:
    """Sum over the devices of each one's standalone tokens/s at its best micro-batch size."""
    chosen = range(cluster.num_devices) if devices is None else devices
    per_type: dict[str, float] = {}
    total = 0.0
    for d in chosen:
        name = cluster.devices[d].type.name
        if name not in per_type:
            per_type[name] = best_standalone_tokens_per_s(
                model, cost, device_type=name, seq_len=seq_len, micro_batch_sizes=micro_batch_sizes,
                adapter=adapter)[0]
        total += per_type[name]
    return total
