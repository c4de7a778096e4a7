"""What a plan fixes (:class:`PlanLayout`) and the per-replica schedules it runs.

The runtime reads plans through this module alone: it imports the schedule IR and the model
spec, never the cost model or the simulator (:mod:`medley.plan.compile` turns a layout into the
simulator's input).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from medley.errors import MedleyInputError
from medley.schedule.generators import generate
from medley.schedule.ir import PipelineSchedule
from medley.schedule.zero import CollectiveMismatchError, Placement, StageZero, place_collectives
from medley.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class PlanLayout:
    """Everything a simulated plan fixes, in global terms.

    Attributes:
        model: the model.
        pp: pipeline ranks per replica; dp: replicas.
        assignment: ``assignment[r][k]`` is the global device id of replica r's pipeline rank k.
        stage_layers: layers (embedding and head count as layers) of each global stage, in order.
        schedule: schedule family; knobs: its integer knobs.
        micro_batches: micro-batches of each replica per step.
        micro_batch_size: sequences per micro-batch; seq_len: tokens per sequence.
        zero: ZeRO settings of each global stage.
        placement: collective placement policy.
        recompute: per global stage, whether blocks recompute their forward before backward.
        dtype: training precision of weights and activations (bf16, fp16 or fp32).
        clip_grad: clip gradients by their global norm; every optimizer step then waits for a
            world-wide all-reduce (``CLIP``) after the last gradient reduction of the step.
    """

    model: ModelSpec
    pp: int
    dp: int
    assignment: tuple[tuple[int, ...], ...]
    stage_layers: tuple[int, ...]
    schedule: str
    micro_batches: tuple[int, ...]
    micro_batch_size: int
    seq_len: int
    zero: tuple[StageZero, ...]
    placement: Placement = Placement.BUBBLE
    recompute: tuple[bool, ...] = ()
    dtype: str = "bf16"
    knobs: dict[str, Any] = field(default_factory=dict)
    clip_grad: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def tied_copies(self) -> bool:
        """Whether the tied embedding weight has two copies (first and last stage), whose gradients
        are summed at the step's ``CLIP`` action: the schedule then always carries one."""
        return self.model.tied_embeddings and self.num_stages > 1

    def layer_range(self, stage: int) -> range:
        # A two-direction schedule holds the model twice: stages p.. restart at layer 0.
        chain = self.pp if self.schedule == "bidirectional" else self.num_stages
        start = sum(self.stage_layers[(stage // chain) * chain : stage])
        return range(start, start + self.stage_layers[stage])

    @property
    def tokens_per_step(self) -> int:
        return sum(self.micro_batches) * self.micro_batch_size * self.seq_len


def build_schedules(layout: PlanLayout) -> list[PipelineSchedule]:
    """One schedule per replica, with the ZeRO collectives placed."""
    schedules = []
    for micro_batches in layout.micro_batches:
        try:
            schedules.append(
                generate(layout.schedule, pp=layout.pp, micro_batches=micro_batches, **layout.knobs)
            )
        except ValueError as err:
            raise MedleyInputError(f"--schedule {layout.schedule}: {err}") from None
    if schedules[0].num_stages != layout.num_stages:
        raise MedleyInputError(
            f"--split gives {layout.num_stages} stages but schedule '{layout.schedule}' with pp={layout.pp} "
            f"has {schedules[0].num_stages}; give one layer count per stage"
        )
    try:
        return place_collectives(
            schedules, layout.zero, stage_layers=layout.stage_layers, policy=layout.placement,
            clip_grad=layout.clip_grad or layout.tied_copies,
        )
    except CollectiveMismatchError as err:
        raise MedleyInputError(f"--zero / --zero-placement / --gather-windows (the plan's layout.zero): "
                               f"{err}") from None
