"""Per-layer costs measured on real GPUs, read from the Metis planner's profile format.

The files, their two layouts and their fields: :mod:`medley.cost.metis_files`. T = 1 files
(tensor-parallel degree 1) answer ``layer_time``; T > 1 files answer ``tp_layer_time``, one TP
rank's time of a block (below). :func:`medley.cost.user_profiles.measured_cost_source` matches
each GPU to a cluster's types.

How the numbers are used:

* ``layer_time`` returns the file's per-layer forward+backward time, split into F, B and W by the
  F:B:W ratio of medley's catalog estimate of the same layer, micro-batch size and sequence length
  (on the same device type when the catalog has it, else on ``REFERENCE_DEVICE``). So F+B+W of a
  layer equals the file's ``layer_compute_total_ms`` exactly; only the division is estimated.
* Micro-batch sizes between two measured ones are interpolated linearly in the time per sequence
  (time per layer = B x interpolated per-sequence time); sizes outside the measured range raise
  :class:`ProfileRangeError` (no extrapolation).
* The files do not record the sequence length. It is inferred from the boundary bytes
  (``activation_parameters_bytes`` = B x seq x hidden x 4 bytes, fp32 as measured) and can be
  given explicitly; asking for another length raises :class:`ProfileRangeError`. Metis's own
  files may lack those bytes (its samples do); when no file has them the length must be given
  (``assumed_seq_len``: the plan's ``--seq-len``). ``forward_backward_time_ms`` may be missing
  too (then the sum of the layers).
* **Tensor parallelism.** A T > 1 file times each layer on one of T ranks of Megatron-style TP,
  its all-reduces included (on the profiling node's own link). ``tp_layer_time`` answers a
  block from it: the file's time less the block's four all-reduces (two in F, two in B, of the
  boundary tensor in the files' fp32) as medley's link model times them on one node of T devices
  of that type, split into F, B and W by the catalog's ratio for the split shapes; the compiler
  adds the all-reduces on the plan's own TP group. Only measured micro-batch sizes answer (no
  interpolation across T files); the embedding and head, which medley replicates on TP ranks
  while Megatron splits them, are answered by ``layer_time``. A T > 1 file may exist where its
  T = 1 file does not (a size that does not fit one device).
* Device types the directory lacks are answered by ``fallback`` (for instance the catalog
  estimate) when one is given, else they raise :class:`ProfileRangeError` as well.
* The file's optimizer time and per-layer memory are kept (:meth:`MetisProfile.optimizer_s`,
  :meth:`MetisProfile.layer_memory_bytes`) but not used: medley's simulator computes memory from
  its own ZeRO-aware model and the optimizer step from memory bandwidth, per stage.
"""

from __future__ import annotations

from bisect import bisect_left
from pathlib import Path

from medley.cost.comm import TopologyCommModel
from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import (
    Collective,
    CostSource,
    MeasuresNothing,
    Pass,
    ProfileRangeError,
    TimeEstimate,
)
from medley.cost.metis_files import (
    PROFILE_ACTIVATION_BYTES,
    MetisProfile,
    load_metis_profile,
)
from medley.cost.tp_cost import TP_ALL_REDUCES
from medley.errors import MedleyInputError
from medley.spec.catalog import load_catalog
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model import ModelSpec

REFERENCE_DEVICE = "A100-40GB"  # F:B:W ratios of types the catalog lacks are this one's


class MetisCostSource(MeasuresNothing):
    """A :class:`CostSource` answering from Metis-format measurements (module docstring has the rules)."""

    def __init__(
        self,
        profile: MetisProfile,
        model: ModelSpec,
        *,
        fallback: CostSource | None = None,
        dtype: str = "bf16",
    ) -> None:
        self.profile = profile
        self.model = model
        self.fallback = fallback
        catalog = load_catalog()
        self._ratio_source = CatalogCostSource(model, dtype=dtype, catalog=catalog)
        self._catalog = catalog
        self._cache: dict[tuple[int, Pass, int, int, str], TimeEstimate] = {}
        self._all_reduce_s: dict[tuple[int, str, int], float] = {}

    @classmethod
    def from_directory(
        cls,
        directory: Path,
        model: ModelSpec,
        *,
        fallback: CostSource | None = None,
        seq_len: int | None = None,
        assumed_seq_len: int | None = None,
        dtype: str = "bf16",
    ) -> MetisCostSource:
        profile = load_metis_profile(directory, model, seq_len=seq_len, assumed_seq_len=assumed_seq_len)
        return cls(profile, model, fallback=fallback, dtype=dtype)

    def layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate:
        key = (layer, Pass(kind), micro_batch_size, seq_len, device_type)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._answer(
                layer, Pass(kind), micro_batch_size, seq_len, device_type
            )
        return cached

    def _answer(self, layer: int, kind: Pass, mbs: int, seq: int, device_type: str) -> TimeEstimate:
        if not self.profile.micro_batch_sizes(device_type):
            if self.fallback is not None:
                return self.fallback.layer_time(
                    layer, kind, micro_batch_size=mbs, seq_len=seq, device_type=device_type
                )
            known = ", ".join(sorted(self.profile.entries))
            raise ProfileRangeError(
                f"--profiles {self.profile.directory}: no profile for device type '{device_type}' "
                f"(profiled: {known}); add one, or plan with the catalog estimate as fallback."
            )
        if seq != self.profile.seq_len:
            raise ProfileRangeError(
                f"--seq-len {seq}: the profiles in {self.profile.directory} were measured at "
                f"{self.profile.seq_len} tokens per sequence; use --seq-len {self.profile.seq_len}."
            )
        total_s, source = self.fwd_bwd_seconds(layer, mbs, device_type)
        return TimeEstimate(seconds=total_s * self._share(layer, kind, mbs, seq, device_type), source=source)

    def fwd_bwd_seconds(self, layer: int, mbs: int, device_type: str) -> tuple[float, str]:
        """The file's forward+backward seconds of ``layer`` (interpolated between sizes) and its source."""
        by_mbs = self.profile.entries[device_type]
        sizes = sorted(by_mbs)
        if mbs in by_mbs:
            entry = by_mbs[mbs]
            return entry.layer_ms[layer] / 1e3, f"metis:{entry.label}"
        if not sizes[0] < mbs < sizes[-1]:
            raise ProfileRangeError(
                f"micro-batch size {mbs}: the profiles for {device_type} in {self.profile.directory} cover "
                f"sizes {sizes}; use one in {sizes[0]}..{sizes[-1]} (medley does not extrapolate)."
            )
        hi = sizes[bisect_left(sizes, mbs)]
        lo = sizes[bisect_left(sizes, mbs) - 1]
        a, b = by_mbs[lo], by_mbs[hi]
        w = (mbs - lo) / (hi - lo)
        per_seq = (1 - w) * a.layer_ms[layer] / lo + w * b.layer_ms[layer] / hi
        name = f"metis:{a.label}~{b.path.name}"
        return per_seq * mbs / 1e3, name

    def _share(self, layer: int, kind: Pass, mbs: int, seq: int, device_type: str, tp: int = 1) -> float:
        """F, B or W's share of the layer's forward+backward, from the catalog estimate (of one of
        ``tp`` ranks' split shapes)."""
        reference = device_type if device_type in self._catalog else REFERENCE_DEVICE
        times = {
            p: self._ratio_source.layer_time(
                layer, p, micro_batch_size=mbs, seq_len=seq, device_type=reference, tp=tp
            ).seconds
            for p in Pass
        }
        return times[kind] / sum(times.values())

    def tp_layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str, tp: int
    ) -> TimeEstimate | None:
        """One of ``tp`` ranks' time of one pass of a block, from the file of that degree and
        micro-batch size, its all-reduces taken out (module docstring); None where no such file
        is, for the embedding and head, and where the catalog does not know the type's link."""
        by_size = self.profile.tp_entries.get(device_type, {}).get(tp, {})
        entry = by_size.get(micro_batch_size)
        if entry is None or self.model.layer_kind(layer) != "block" or seq_len != self.profile.seq_len:
            return None
        if device_type not in self._catalog:
            return None
        total = entry.layer_ms[layer] / 1e3 - self._profiled_all_reduces(micro_batch_size, device_type, tp)
        if total <= 0:
            raise MedleyInputError(
                f"{entry.path}: layer {layer} takes {entry.layer_ms[layer]} ms, less than its TP all-reduces "
                f"on {device_type} by medley's link model; the file cannot be a TP {tp} measurement."
            )
        share = self._share(layer, Pass(kind), micro_batch_size, seq_len, device_type, tp)
        return TimeEstimate(seconds=total * share, source=f"metis:{entry.label}")

    def _profiled_all_reduces(self, mbs: int, device_type: str, tp: int) -> float:
        """Seconds of a block's two F and two B all-reduces of the fp32 boundary tensor over one
        node of ``tp`` devices of ``device_type``, as medley's link model times them."""
        key = (mbs, device_type, tp)
        if key not in self._all_reduce_s:
            node = parse_cluster_arg(f"{tp}x{device_type}")
            nbytes = mbs * self.profile.seq_len * self.model.hidden_size * PROFILE_ACTIVATION_BYTES
            one = TopologyCommModel(node).collective_time(Collective.ALL_REDUCE, tuple(range(tp)), nbytes)
            self._all_reduce_s[key] = (TP_ALL_REDUCES[Pass.F] + TP_ALL_REDUCES[Pass.B]) * one
        return self._all_reduce_s[key]
