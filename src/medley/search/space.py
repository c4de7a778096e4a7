"""The planner's search space as data: structures (devices and their roles) and candidates (a
complete plan choice with its analytic estimate), and the constants that bound the space.

:mod:`medley.search.rules.candidates` builds candidates from structures; the ranking simulates them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from medley.cost.recompute import NONE, Recompute, parse_recompute
from medley.plan.layout import PlanLayout, planned_sequence_parallel
from medley.plan.segments import joined
from medley.schedule.zero_settings import Placement, StageZero
from medley.spec.adapter import LoraSpec
from medley.spec.model import ModelSpec

PP_CHOICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128)
# On large pools every candidate costs more; the odd depths rarely win there.
PP_CHOICES_LARGE = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
LARGE_POOL = 128
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
SEARCHED_FAMILIES = ("1f1b", "zb-h1", "interleaved", "hetero-1f1b", "gpipe")
DEFAULT_FAMILIES = ("1f1b", "zb-h1", "interleaved", "hetero-1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOption:
    """One way to make a stage fit.

    Attributes:
        zero: the stage's ZeRO setting (:class:`medley.schedule.zero_settings.StageZero`; its
            ``buckets`` may exceed a short stage's layers, the layout clamps them).
        recompute: what the stage recomputes (:class:`medley.cost.recompute.Recompute`; True: full).
    """

    zero: StageZero
    recompute: Recompute = NONE

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, Recompute):
            object.__setattr__(self, "recompute", parse_recompute(self.recompute))

    @property
    def level(self) -> int:
        return self.zero.level

    @property
    def buckets(self) -> int:
        return self.zero.buckets

    @property
    def streams(self) -> bool:
        return self.zero.streams


def memory_option(level: int, *, buckets: int = 4, recompute: Recompute | bool = NONE) -> MemoryOption:
    """The searched option at ZeRO ``level`` in ``buckets`` buckets: the search's ZeRO-3 is
    streamed (gather windows 0: each compute action gathers its buckets and frees them)."""
    zero = StageZero(level=level, buckets=buckets, gather_windows=0 if level == 3 else 1)
    return MemoryOption(zero=zero, recompute=recompute)  # type: ignore[arg-type] - parsed after


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Limits on the search.

    Attributes:
        max_pp: most pipeline ranks per replica (None: up to the layer count).
        schedules: schedule families to consider (subset of ``SEARCHED_FAMILIES``).
        memory_headroom: fraction of each device's memory left free (fragmentation, CUDA context).
        exclude_devices: device ids left out of every plan.
        micro_batch_sizes: sizes to consider (None: 1, 2, 4, 8, 16).
        tp_degrees: tensor-parallel degrees a pipeline rank may take (None: every degree the model
            and the nodes allow; ``(1,)``: no tensor parallelism).
        asymmetric: also plan replica groups of their own shape, one per device type
            (:mod:`medley.search.rules.asymmetric`); False: every replica alike.
        dtype: the precision every plan trains in (bf16, fp16 or fp32); None: the half precision
            the devices allow (:func:`medley.spec.catalog.half_precision`).
        adapter: LoRA adapters every plan trains, the base frozen (:mod:`medley.spec.adapter`);
            None: full training.
    """

    max_pp: int | None = None
    schedules: tuple[str, ...] = DEFAULT_FAMILIES
    memory_headroom: float = 0.05
    exclude_devices: tuple[int, ...] = ()
    micro_batch_sizes: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = None
    asymmetric: bool = True
    dtype: str | None = None
    adapter: LoraSpec | None = None


@dataclass(frozen=True, kw_only=True)
class Structure:
    """Devices and their roles, before the split and the schedule are chosen.

    ``assignment[r][k]`` is the first device of replica r's pipeline rank k; ``tp[k]`` (empty: 1
    everywhere) its tensor-parallel degree, the group being consecutive device ids
    (:meth:`medley.plan.layout.PlanLayout.group`). ``sync_dp``: the replicas its ZeRO groups span
    when it is one replica group of a plan with others (:mod:`medley.search.rules.asymmetric`; 0: its
    own ``dp``), over which the memory rules shard; ``sync_with``: devices of those other groups,
    one per group, which the estimate adds to each pipeline rank's DP ring (their links are the
    ring's)."""

    pool: str
    strategy: str
    pp: int
    dp: int
    assignment: tuple[tuple[int, ...], ...]
    micro_batch_size: int
    tp: tuple[int, ...] = ()
    sync_dp: int = 0
    sync_with: tuple[int, ...] = ()

    @property
    def zero_dp(self) -> int:
        """Members of each ZeRO group (:attr:`medley.plan.layout.PlanLayout.zero_dp`)."""
        return self.sync_dp or self.dp

    def tp_of(self, pipeline_rank: int) -> int:
        """Tensor-parallel degree of ``pipeline_rank`` (1 where the structure has no ``tp``)."""
        return self.tp[pipeline_rank] if self.tp else 1

    @property
    def num_devices(self) -> int:
        """Devices the structure uses: dp x the pipeline ranks' TP degrees."""
        return self.dp * sum(self.tp_of(k) for k in range(self.pp))


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A complete plan choice with its analytic estimate (``estimate_s``: step seconds)."""

    structure: Structure
    family: str
    knobs: dict[str, Any] = field(default_factory=dict)
    micro_batches: tuple[int, ...]
    stage_layers: tuple[int, ...]
    options: tuple[MemoryOption, ...]
    estimate_s: float
    dtype: str
    adapter: LoraSpec | None = None

    def layout(self, model: ModelSpec, seq_len: int) -> PlanLayout:
        st = self.structure
        return PlanLayout(
            model=model,
            pp=st.pp,
            dp=st.dp,
            assignment=st.assignment,
            stage_layers=self.stage_layers,
            schedule=self.family,
            micro_batches=self.micro_batches,
            micro_batch_size=st.micro_batch_size,
            seq_len=seq_len,
            zero=tuple(
                replace(o.zero, buckets=max(1, min(o.buckets, n)))
                for o, n in zip(self.options, self.stage_layers, strict=True)
            ),
            placement=Placement.BUBBLE,
            recompute=tuple(o.recompute for o in self.options),
            dtype=self.dtype,
            knobs=dict(self.knobs),
            # Training clips by the global norm (medley train's default, as in Megatron and
            # torchtitan): every plan is timed with the CLIP barrier before its optimizer steps.
            clip_grad=True,
            tp=st.tp,
            sequence_parallel=planned_sequence_parallel(seq_len, st.tp),
            adapter=self.adapter,
        )

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two candidates the same plan (the estimate and the pool do not)."""
        st = self.structure
        return (
            st.assignment,
            st.tp,
            st.micro_batch_size,
            self.family,
            tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(self.knobs.items())),
            self.micro_batches,
            self.stage_layers,
            self.options,
        )


@dataclass(frozen=True, kw_only=True)
class GroupedCandidate:
    """Replica groups of their own shape with their analytic estimate.

    Attributes:
        parts: one candidate per group (device type), each on its own devices.
        estimate_s: the slowest group's estimated step.
        dtype: the plan's precision (fp16 when any type lacks bf16).
    """

    parts: tuple[Candidate, ...]
    estimate_s: float
    dtype: str

    @property
    def key(self) -> tuple:
        return ("groups", *(part.key for part in self.parts))

    @property
    def pool(self) -> str:
        return "groups:" + "+".join(part.structure.pool for part in self.parts)

    def layouts(self, model: ModelSpec, seq_len: int) -> tuple[PlanLayout, ...]:
        """The groups' layouts in one precision, their ZeRO settings made one (the planner builds
        every part at one level, :mod:`medley.search.rules.asymmetric`; should parts differ, the highest
        level any stage chose, streamed if any streams, which never holds more memory)."""
        options = [o for part in self.parts for o in part.options]
        level = max(o.level for o in options)
        streams = any(o.streams for o in options if o.level == level)
        layouts = []
        for part in self.parts:
            layout = part.layout(model, seq_len)
            zero = tuple(StageZero(level=level, buckets=z.buckets, gather_windows=0 if streams else 1)
                         for z in layout.zero)
            layouts.append(replace(layout, zero=zero, dtype=self.dtype))
        return joined(layouts)


def distribute(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``total`` items over len(weights) parts in proportion to the weights, each at least one
    (largest remainder; ties to the lower index)."""
    parts = len(weights)
    if total < parts:
        raise ValueError(f"{total} items cannot give each of {parts} parts one")
    scale = sum(weights)
    ideal = [1 + (total - parts) * w / scale for w in weights]
    counts = [int(math.floor(x)) for x in ideal]
    order = sorted(range(parts), key=lambda i: (-(ideal[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return tuple(counts)
