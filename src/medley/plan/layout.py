"""What a plan fixes (:class:`PlanLayout`) and the per-replica schedules it runs.

The runtime reads plans through this module alone: it imports the schedule IR and the model
spec, never the cost model or the simulator (:mod:`medley.lowering.compile` turns a layout into the
simulator's input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from medley.cost.recompute import Recompute, parse_recompute
from medley.errors import MedleyInputError
from medley.schedule.zero_settings import Placement, StageZero
from medley.spec.adapter import LoraSpec
from medley.spec.cluster import Cluster
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
        recompute: per global stage, how its blocks recompute in the backward
            (:class:`medley.cost.recompute.Recompute`: none, full, selective, or either on the
            stage's first k blocks); bools are read as full (True) and none (False).
        dtype: training precision of weights and activations (bf16, fp16 or fp32).
        clip_grad: clip gradients by their global norm; every optimizer step then waits for a
            world-wide all-reduce (``CLIP``) after the last gradient reduction of the step.
        tp: tensor-parallel degree of each pipeline rank (Megatron-style, within one node); empty:
            1 everywhere. Pipeline rank k of replica r runs on the ``tp[k]`` consecutive device ids
            from ``assignment[r][k]`` (:meth:`group`); an interleaved rank's stages share its
            degree, and every replica uses the same degrees.
        sync_dp: replicas the plan's ZeRO groups span: the replicas of every replica group of an
            asymmetric plan (:mod:`medley.plan.segments`), whose replicas each hold every layer
            once; 0 (a plan of alike replicas): ``dp``. What a ZeRO level shards is cut into
            ``zero_dp`` pieces.
        sequence_parallel: every stage of TP degree above 1 runs sequence parallelism (torch's
            ``SequenceParallel`` norms, all-gather and reduce-scatter in place of the all-reduces,
            :mod:`medley.runtime.tensor_parallel`); needs ``seq_len`` divisible by each degree.
        adapter: LoRA adapters on the blocks (:class:`medley.spec.adapter.LoraSpec`), the base
            frozen; None: every weight trains.
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
    recompute: tuple[Recompute, ...] = ()
    dtype: str = "bf16"
    knobs: dict[str, Any] = field(default_factory=dict)
    clip_grad: bool = False
    tp: tuple[int, ...] = ()
    sync_dp: int = 0
    sequence_parallel: bool = False
    adapter: LoraSpec | None = None

    def __post_init__(self) -> None:
        if not all(isinstance(r, Recompute) for r in self.recompute):
            object.__setattr__(self, "recompute", tuple(parse_recompute(r) for r in self.recompute))

    def stage_recompute(self, stage: int) -> Recompute:
        """Global stage ``stage``'s recomputation (none where the plan names none)."""
        return self.recompute[stage] if self.recompute else Recompute()

    @property
    def zero_dp(self) -> int:
        """Members of each ZeRO group: every replica of the plan (``sync_dp``, else ``dp``)."""
        return self.sync_dp or self.dp

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
    def sequences_per_step(self) -> int:
        """Sequences of the global batch (every replica's micro-batches)."""
        return sum(self.micro_batches) * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len

    def tp_of(self, pipeline_rank: int) -> int:
        """Tensor-parallel degree of ``pipeline_rank`` (1 where the plan has no ``tp``)."""
        return self.tp[pipeline_rank] if self.tp else 1

    def stage_tp(self, stage: int) -> int:
        """Tensor-parallel degree of global stage ``stage`` (that of the pipeline rank holding it:
        stage % pp, except the up pipeline of a two-direction schedule, which runs back from
        rank pp-1)."""
        if self.schedule == "bidirectional" and stage >= self.pp:
            return self.tp_of(2 * self.pp - 1 - stage)
        return self.tp_of(stage % self.pp)

    def group(self, replica: int, pipeline_rank: int) -> tuple[int, ...]:
        """Device ids of replica ``replica``'s pipeline rank ``pipeline_rank``, TP rank order."""
        first = self.assignment[replica][pipeline_rank]
        return tuple(range(first, first + self.tp_of(pipeline_rank)))

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the plan uses, replica by replica, pipeline rank by rank, TP rank by rank."""
        return tuple(d for r in range(self.dp) for k in range(self.pp) for d in self.group(r, k))

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: ``dp`` x the sum of the pipeline ranks' TP degrees."""
        return self.dp * sum(self.tp_of(k) for k in range(self.pp))


TP_DEGREES = (1, 2, 4, 8)


def planned_sequence_parallel(seq_len: int, degrees: tuple[int, ...]) -> bool:
    """Whether the planner runs sequence parallelism: whenever some degree is above 1 and
    ``seq_len`` divides by each (it never holds more activation memory than plain TP, and its
    all-gathers and reduce-scatters move the all-reduces' bytes; the edges' gathers aside)."""
    return any(t > 1 for t in degrees) and all(seq_len % t == 0 for t in degrees)


def sequence_sharded_edges(layout: PlanLayout) -> frozenset[int]:
    """Stages s whose output reaches stage s + 1 as each TP rank's sequence shard under sequence
    parallelism (:func:`sharded_edges` of the layout's stages; none without it). The runtime and
    the compiler read this one rule."""
    if not layout.sequence_parallel:
        return frozenset()
    ranges = [layout.layer_range(s) for s in range(layout.num_stages)]
    return sharded_edges(layout.model, ranges, [layout.stage_tp(s) for s in range(layout.num_stages)])


def sharded_edges(model: ModelSpec, ranges: list[range], degrees: list[int]) -> frozenset[int]:
    """Stages s (layers ``ranges[s]``, TP degree ``degrees[s]``) whose output crosses to s + 1 as
    a sequence shard: both hold blocks at the edge (s's last layer, s + 1's first) on groups of
    one degree above 1, rank j feeding rank j; every other edge carries whole tensors (or
    scattered ones, :func:`tp_scattered`)."""
    out = set()
    for stage in range(len(ranges) - 1):
        here, there = ranges[stage], ranges[stage + 1]
        if (there.start == here.stop and degrees[stage] > 1 and degrees[stage + 1] == degrees[stage]
                and model.layer_kind(here.stop - 1) == "block" and model.layer_kind(there.start) == "block"):
            out.add(stage)
    return frozenset(out)


def tp_sources(*, senders: int, receivers: int) -> tuple[int, ...]:
    """Which TP rank of a sending group feeds each TP rank of a receiving group at a pipeline hop.

    A stage's output (after its last row-parallel layer's all-reduce) and the gradient of its
    input are whole on every TP rank of its group, so receiving rank ``j`` takes the tensor from
    sending rank ``j % senders``: one transfer per receiving rank, equal degrees pair rank with
    rank, and a sender past the receivers' count sends nothing. Activations (forward) and input
    gradients (backward) follow the same rule with the roles swapped. Between groups of one
    degree above 1 each transfer carries a slice only (:func:`tp_scattered`)."""
    return tuple(j % senders for j in range(receivers))


def tp_scattered(*, senders: int, receivers: int) -> bool:
    """Whether a pipeline hop between TP groups of these degrees is scattered, as Megatron-LM
    scatters and gathers pipeline tensors: between groups of one degree t above 1, sending rank j
    sends only slice j of t of the flattened tensor (whole on every sender) to receiving rank j,
    and the receiving group all-gathers the slices in the compute action that uses the tensor
    (the forward of the activation, the backward of the gradient). Across nodes the network then
    carries the tensor once instead of t times. Groups of unlike degrees send whole tensors."""
    return senders == receivers > 1


def tp_undivided(model: ModelSpec, tp: int) -> str | None:
    """The first of the model's heads, KV heads, MLP width and hidden size (``name (size)``) that
    ``tp`` does not divide, or None: Megatron's TP splits each of the first three over the group,
    and a scattered pipeline hop the hidden states (:func:`tp_scattered`)."""
    for name, size in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                       ("ffn_hidden_size", model.ffn_hidden_size), ("hidden_size", model.hidden_size)):
        if size % tp:
            return f"{name} ({size})"
    return None


def check_tp(layout: PlanLayout, cluster: Cluster) -> None:
    """Refuse a ``tp`` the cluster or the model cannot run: one degree per pipeline rank, each in
    :data:`TP_DEGREES`, dividing the model's heads, KV heads and MLP width, and every TP group on
    one node, of one device type, inside the cluster. Errors name ``--tp`` / ``layout.tp``."""
    if not layout.tp:
        return
    where = "--tp (the plan's layout.tp)"
    if len(layout.tp) != layout.pp:
        raise MedleyInputError(f"{where}: {len(layout.tp)} degrees for pp {layout.pp}; give one per "
                               "pipeline rank")
    model = layout.model
    for k, t in enumerate(layout.tp):
        if t not in TP_DEGREES:
            raise MedleyInputError(f"{where}: degree {t} of pipeline rank {k} is not one of {TP_DEGREES}")
        undivided = tp_undivided(model, t)
        if undivided is not None:
            raise MedleyInputError(f"{where}: degree {t} does not divide the model's {undivided}; "
                                   "choose a degree that does")
    for r in range(layout.dp):
        for k in range(layout.pp):
            group = layout.group(r, k)
            if group[-1] >= cluster.num_devices:
                raise MedleyInputError(f"{where}: replica {r} pipeline rank {k} needs devices {group[0]}.."
                                       f"{group[-1]} but the cluster has {cluster.num_devices}; lower tp")
            if not cluster.one_node_one_type(group):
                raise MedleyInputError(
                    f"{where}: replica {r} pipeline rank {k} would span devices {group[0]}..{group[-1]}, "
                    "which are not one node of one device type; a TP group is consecutive device "
                    "ids on one node of one type: start it elsewhere (--devices) or lower tp")
    uneven = [t for t in layout.tp if t > 1 and layout.seq_len % t]
    if layout.sequence_parallel and uneven:
        raise MedleyInputError(f"--sequence-parallel (the plan's layout.sequence_parallel): seq_len "
                               f"{layout.seq_len} is not divisible by TP degree {uneven[0]}; choose a "
                               "seq_len that is, or turn sequence parallelism off")
    used = layout.devices
    if len(set(used)) != len(used):
        raise MedleyInputError(f"{where}: the TP groups overlap (a device appears twice); start each "
                               "group past the previous one's last device")


def speed_split(model: ModelSpec, stage_speed: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage in proportion to each stage's speed, at least one each (largest
    remainder first)."""
    stages = len(stage_speed)
    if stages > model.num_layers:
        raise MedleyInputError(
            f"{stages} stages need at least {stages} layers; {model.name} has {model.num_layers}"
        )
    total_speed = sum(stage_speed)
    ideal = [model.num_layers * s / total_speed for s in stage_speed]
    split = [max(1, int(x)) for x in ideal]
    while sum(split) < model.num_layers:
        gaps = [ideal[i] - split[i] for i in range(stages)]
        split[gaps.index(max(gaps))] += 1
    while sum(split) > model.num_layers:
        movable = [i for i in range(stages) if split[i] > 1]
        split[max(movable, key=lambda i: split[i] - ideal[i])] -= 1
    return tuple(split)


def uniform_split(model: ModelSpec, stages: int) -> tuple[int, ...]:
    """As even a split as the layer count allows."""
    return speed_split(model, [1.0] * stages)
