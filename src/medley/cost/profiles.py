"""A :class:`CostSource` that answers from medley's measured profile file
(:mod:`medley.cost.profile_format`).

:class:`ProfileCostSource` matches a query by the model's layer kind, micro-batch size and
sequence length. Shapes between measured ones are interpolated (linearly in the micro-batch size
at a measured sequence length, then linearly in the sequence length); shapes outside the measured
range, other models and other device types go to the fallback source, or raise a
:class:`~medley.cost.interfaces.ProfileRangeError` naming what is missing when there is none.
Every answer says where it came from: ``profile:<file>`` for a measured shape,
``profile:<file>~interpolated`` otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from medley.cost.interfaces import CostSource, MeasuresNothing, Pass, ProfileRangeError, TimeEstimate
from medley.cost.profile_format import LayerMeasurement, Profile, load_profile
from medley.spec.model import ModelSpec


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Figures:
    """The per-pass times and activation bytes of one (kind, shape), measured or interpolated."""

    times: dict[Pass, float]
    backward_full_s: float
    activation_bytes: float
    activation_after_b_bytes: float
    workspace_bytes: float
    fsdp_extra: dict[Pass, float]
    tp_extra: dict[Pass, float]
    exact: bool

    @staticmethod
    def of(m: LayerMeasurement) -> _Figures:
        times = {Pass.F: m.forward_s, Pass.B: m.backward_input_s, Pass.W: m.backward_weight_s}
        return _Figures(times=times, backward_full_s=m.backward_full_s, activation_bytes=m.activation_bytes,
                        activation_after_b_bytes=m.activation_after_b_bytes,
                        workspace_bytes=m.backward_workspace_bytes,
                        fsdp_extra=_extra(m, m.fsdp_forward_s, m.fsdp_backward_full_s),
                        tp_extra=_extra(m, m.tp_forward_s, m.tp_backward_full_s), exact=True)

    def lerp(self, other: _Figures, x: float, x0: float, x1: float) -> _Figures:
        return _Figures(
            times={p: _lerp(x, x0, x1, self.times[p], other.times[p]) for p in Pass},
            backward_full_s=_lerp(x, x0, x1, self.backward_full_s, other.backward_full_s),
            activation_bytes=_lerp(x, x0, x1, self.activation_bytes, other.activation_bytes),
            activation_after_b_bytes=_lerp(x, x0, x1, self.activation_after_b_bytes,
                                           other.activation_after_b_bytes),
            workspace_bytes=_lerp(x, x0, x1, self.workspace_bytes, other.workspace_bytes),
            fsdp_extra={p: _lerp(x, x0, x1, self.fsdp_extra[p], other.fsdp_extra[p]) for p in Pass},
            tp_extra={p: _lerp(x, x0, x1, self.tp_extra[p], other.tp_extra[p]) for p in Pass},
            exact=False,
        )


def _extra(m: LayerMeasurement, wrapped_forward: float | None, wrapped_backward: float | None
           ) -> dict[Pass, float]:
    """A wrapper's (FSDP2's, TP's) added time per pass; the backward's is split between B and W
    like the backward."""
    forward = max(0.0, (wrapped_forward or m.forward_s) - m.forward_s)
    backward = max(0.0, (wrapped_backward or m.backward_full_s) - m.backward_full_s)
    split = m.backward_input_s + m.backward_weight_s
    share = m.backward_input_s / split if split > 0 else 0.5
    return {Pass.F: forward, Pass.B: backward * share, Pass.W: backward * (1 - share)}


def _bracket(values: list[int], x: int) -> tuple[int, int] | None:
    below = [v for v in values if v <= x]
    above = [v for v in values if v >= x]
    return (max(below), min(above)) if below and above else None


@dataclass(kw_only=True)
class ProfileCostSource(MeasuresNothing):
    """Layer times (and activation bytes) from a profile, for the device types it stands for.

    Attributes:
        profile: the loaded profile.
        name: how answers name their source, ``profile:<name>`` (the file name by default).
        fallback: answers what the profile lacks (another model, device type or shape); None
            makes those queries an error.
        device_scale: device type name -> factor applied to the profile's times. By default the
            profile's own ``device_type`` at 1.0; an emulated cluster maps its slowed types here.
        model: the model the plan trains; the profile answers only if it has the same shape.
    """

    profile: Profile
    name: str
    model: ModelSpec
    fallback: CostSource | None = None
    device_scale: Mapping[str, float] = field(default_factory=dict)
    _cache: dict[tuple[str, int, int], _Figures | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.device_scale:
            self.device_scale = {self.profile.device_type: 1.0}
        self.matches_model = _same_shape(self.profile.model_spec(), self.model)

    @property
    def source(self) -> str:
        return f"profile:{self.name}"

    def figures(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> _Figures | None:
        """Measured or interpolated figures for the query, or None when the profile cannot say."""
        if not self.matches_model or device_type not in self.device_scale:
            return None
        kind = self.model.layer_kind(layer)
        key = (kind, micro_batch_size, seq_len)
        if key not in self._cache:
            self._cache[key] = self._lookup(kind, micro_batch_size, seq_len)
        return self._cache[key]

    def _lookup(self, kind: str, mbs: int, seq: int) -> _Figures | None:
        rows = [m for m in self.profile.layers if m.kind == kind]
        seqs = sorted({m.seq_len for m in rows})
        pair = _bracket(seqs, seq)
        if pair is None:
            return None
        ends = [self._at_seq(rows, s, mbs) for s in pair]
        if ends[0] is None or ends[1] is None:
            return None
        if pair[0] == pair[1]:
            return ends[0]
        return ends[0].lerp(ends[1], seq, pair[0], pair[1])

    @staticmethod
    def _at_seq(rows: list[LayerMeasurement], seq: int, mbs: int) -> _Figures | None:
        at = {m.micro_batch_size: m for m in rows if m.seq_len == seq}
        pair = _bracket(sorted(at), mbs)
        if pair is None:
            return None
        low, high = _Figures.of(at[pair[0]]), _Figures.of(at[pair[1]])
        return low if pair[0] == pair[1] else low.lerp(high, mbs, pair[0], pair[1])

    def layer_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate:
        found = self.figures(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )
        if found is None:
            if self.fallback is None:
                raise ProfileRangeError(self._missing(layer, micro_batch_size, seq_len, device_type))
            return self.fallback.layer_time(
                layer, kind, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
            )
        seconds = found.times[Pass(kind)] * self.device_scale[device_type]
        return TimeEstimate(seconds=seconds, source=self.source + ("" if found.exact else "~interpolated"))

    def backward_full_time(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> TimeEstimate | None:
        """The fused backward (what 1F1B-style schedules run), or None where the profile cannot say."""
        found = self.figures(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )
        if found is None:
            return None
        return TimeEstimate(seconds=found.backward_full_s * self.device_scale[device_type],
                            source=self.source + ("" if found.exact else "~interpolated"))

    def fsdp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        """Seconds FSDP2's hooks add to one pass of the layer (ZeRO-2/3 stages), or None."""
        found = self.figures(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )
        return None if found is None else found.fsdp_extra[Pass(kind)] * self.device_scale[device_type]

    def tp_extra_time(
        self, layer: int, kind: Pass, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        """Seconds torch's tensor parallelism (DTensor dispatch) adds to one pass of a block on a
        TP group, beyond its split compute and all-reduces, or None."""
        found = self.figures(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )
        return None if found is None else found.tp_extra[Pass(kind)] * self.device_scale[device_type]

    def optimizer_time(self, params: float, *, device_type: str) -> TimeEstimate | None:
        fit = self.profile.optimizer
        if fit is None or device_type not in self.device_scale:
            return None
        seconds = (fit.fixed_s + fit.per_param_s * params) * self.device_scale[device_type]
        return TimeEstimate(seconds=seconds, source=self.source)

    def action_overhead_time(self, *, device_type: str) -> float | None:
        """Seconds the runtime's executor adds to every compute action on ``device_type``, or None."""
        fit = self.profile.overhead
        if fit is None or device_type not in self.device_scale:
            return None
        return fit.action_s * self.device_scale[device_type]

    def p2p_overhead_time(self) -> float | None:
        """Seconds one point-to-point hand-off adds to a transfer beyond the link, or None."""
        fit = self.profile.overhead
        return None if fit is None else fit.p2p_handoff_s

    def collective_overhead_time(self) -> float | None:
        """Seconds the runtime adds to each ZeRO gather or reduction beyond the link, or None."""
        fit = self.profile.overhead
        return None if fit is None else fit.collective_s

    def activation_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> tuple[float, float] | None:
        """(held from F to B, still held from B to W) as measured, or None (use the formulas)."""
        found = self.figures(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )
        return None if found is None else (found.activation_bytes, found.activation_after_b_bytes)

    def workspace_bytes(
        self, layer: int, *, micro_batch_size: int, seq_len: int, device_type: str
    ) -> float | None:
        """Transient bytes of one backward beyond the held activations, or None (unknown)."""
        found = self.figures(
            layer, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=device_type
        )
        return None if found is None else found.workspace_bytes

    def _missing(self, layer: int, mbs: int, seq: int, device_type: str) -> str:
        where = f"profile {self.name}"
        if not self.matches_model:
            return (f"{where} measured model '{self.profile.model.get('name')}', not '{self.model.name}' "
                    f"(or another shape of it); profile this model with `medley profile --model ...`")
        if device_type not in self.device_scale:
            return (f"{where} measured device type '{self.profile.device_type}', not '{device_type}'; "
                    "profile that device or let the catalog answer for it")
        kind = self.model.layer_kind(layer)
        shapes = sorted({(m.micro_batch_size, m.seq_len) for m in self.profile.layers if m.kind == kind})
        return (f"{where} has no {kind} layer at micro-batch size {mbs}, seq len {seq} and cannot "
                f"interpolate it from the measured (micro-batch size, seq len) {shapes}; re-profile with "
                "--micro-batch-sizes and --seq-len covering it")


def _same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    """Equal in everything that sets layer costs (the name may differ)."""
    return dataclasses.replace(a, name=b.name) == b


def profile_cost_source(
    path: Path, model: ModelSpec, *, fallback: CostSource | None = None,
    device_scale: Mapping[str, float] | None = None,
) -> ProfileCostSource:
    """Load ``path`` into a :class:`ProfileCostSource` named after the file."""
    profile = load_profile(path)
    return ProfileCostSource(profile=profile, name=Path(path).name, model=model, fallback=fallback,
                             device_scale=dict(device_scale or {}))
