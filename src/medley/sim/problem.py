"""The simulator's input: schedules, device placement and durations, as plain numbers.

The caller (the planner, the CLI) turns a plan and a cost model into a :class:`SimProblem`; the
simulator never looks at layers, models or device types, only at seconds and bytes. Memory is
modelled as ``static`` (resident all step) plus transient buffers that actions allocate and free:

* activations: ``activation_bytes`` from the start of F until its backward releases them
  (B keeps ``activation_after_b_bytes`` until W; BW frees everything);
* the full gradient buffer of a stage, ``grad_buffer_bytes``, made by the rank's first W or BW
  of that stage (none exists before a step's first backward) and held until REDUCE_GRADs free it
  or the step ends. The gradient grows as that backward frees its activations, so the action
  holds the larger of the two: its start books the gradient's excess over the bytes it frees,
  its end frees the rest. Reductions free
  at most what is live, and the next W/BW after the buffer is fully freed allocates it again
  (several reduce-scatter rounds per step, or streaming ZeRO-3);
* ZeRO collectives, described per action by :class:`CollectiveCost` (gathered weights, ...).

How a caller fills :class:`CollectiveCost` for ZeRO levels 0..3 (one bucket = one stage here;
with layer buckets give each bucket its share of the bytes), as :mod:`medley.lowering.compile` does
from :mod:`medley.cost.zero_memory`'s table. ``P``: the stage's gathered weight bytes, ``G``:
its unsharded gradient bytes (``grad_buffer_bytes = G`` at every level), ``d``: the DP group
size, group: the devices that run the stage in every replica.

* level 0: REDUCE_GRAD is ``ALL_REDUCE`` of ``G`` bytes and frees nothing (the gradient lives
  until the step ends); OPTIM ``compute_s`` = full optimizer step.
* level 1: REDUCE_GRAD ``REDUCE_SCATTER`` of ``G``, ``free_bytes = G``; OPTIM on the shard; an
  UNSHARD after OPTIM (``ALL_GATHER`` of ``P``, ``alloc_bytes=0`` since the gathered weights are
  static) re-broadcasts the updated weights.
* level 2: as level 1 (static holds the ``G/d`` gradient shard too).
* level 3: as level 2, plus UNSHARD ``ALL_GATHER`` of ``P`` with ``alloc_bytes = P`` before the
  stage's compute and RESHARD ``free_bytes = P`` after (static holds the shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from medley.cost.interfaces import Collective, CommModel
from medley.schedule.ir import Action, Kind, PipelineSchedule


@dataclass(kw_only=True, slots=True)
class StageCost:
    """Durations and bytes of one stage for one micro-batch, on the device that runs it.

    Attributes:
        forward_s: time of F.
        backward_input_s: time of B (input gradient). BW takes ``backward_input_s + backward_weight_s``.
        backward_weight_s: time of W (weight gradient).
        activation_bytes: held from the start of F until the micro-batch's B or BW ends.
        activation_after_b_bytes: still held between the end of B and the end of W.
        send_bytes: the stage's output activation per micro-batch, sent to the next stage; the
            gradient coming back into this stage from the next one has the same size.
        grad_buffer_bytes: full (unsharded) gradient made by the rank's first W or BW of this
            stage (netted against the activations that action frees, see above), freed by
            REDUCE_GRAD ``free_bytes`` (capped at what is still live) and allocated again by the
            next W/BW once fully freed; 0 for none.
        workspace_bytes: held while a backward (B, W or BW) of this stage runs, beyond its
            activations: temporaries, gradients of intermediates, recomputed activations.
        send_back_bytes: bytes timed for the gradient the next stage sends back into this one
            (None: ``send_bytes``); they differ when the two stages' tensor-parallel groups
            load their links unlike in the two directions.
    """

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    activation_bytes: float = 0.0
    activation_after_b_bytes: float = 0.0
    send_bytes: float = 0.0
    grad_buffer_bytes: float = 0.0
    workspace_bytes: float = 0.0
    send_back_bytes: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCost:
    """What one ZeRO action (UNSHARD, RESHARD, REDUCE_GRAD, OPTIM) of one replica does.

    Actions of the same kind, stage and bucket on the devices of ``group`` are one collective; the
    n-th occurrence on one member matches the n-th on the others. Members issue it in their own
    list order; it starts when every member has issued it and every member's collective stream
    is free (streams run their collectives in list order), and it occupies those streams and the
    links of the ring ``group[0] -> group[1] -> ... -> group[0]`` for
    ``comm.collective_time(op, group, nbytes)``.

    Attributes:
        group: global device ids of the DP group, in ring order; must contain the issuing device.
            A group of one (or ``op=None``) has no communication.
        op: the collective, or None for local actions (RESHARD frees memory, OPTIM computes).
        nbytes: full (unsharded) buffer size handed to ``CommModel.collective_time``.
        compute_s: OPTIM: time on the device's compute stream. OPTIM waits for the rank's
            latest REDUCE_GRAD of the same stage (and bucket, if it names one) listed before it.
            CLIP: seconds added to the collective's duration (the tied embeddings' gradient sum
            the world waits for, :func:`medley.cost.tied_cost.tied_sum_seconds`; it is timed on the
            CLIP's streams, not on the links of the two stages' devices). UNSHARD, REDUCE_GRAD:
            seconds added to the collective's duration too (the runtime's work around the call,
            ``OverheadProfile.collective_s``).
        alloc_bytes: memory added on this device when the action starts (UNSHARD: gathered
            weights; REDUCE_GRAD: the runtime's reduction buffers, booked by the first reduction
            of the stage's bucket in the step only, since later ones accumulate into them).
        free_bytes: memory released on this device when the action ends (RESHARD: gathered
            weights; REDUCE_GRAD: the full gradient buffer, down to the shard held in static).
        unit: what identifies the collective among its members instead of the action's stage and
            bucket, where members hold it at unlike stages (replicas of their own shape: a sync
            segment's bucket, :mod:`medley.plan.segments`); None: stage and bucket.
    """

    group: tuple[int, ...]
    op: Collective | None
    nbytes: float = 0.0
    compute_s: float = 0.0
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    unit: tuple[int, int] | None = None


CollectiveTable = Callable[[int, Action], CollectiveCost]
"""``table(replica, action)`` -> what that replica's collective action does."""


@dataclass(kw_only=True, slots=True)
class SimProblem:
    """Everything one simulated training step needs.

    Attributes:
        schedules: one per DP replica; micro-batch counts may differ. Compute-only schedules are
            lowered as :func:`medley.schedule.ir.add_send_recv` does; lowered ones run as given.
        devices: ``devices[r][k]`` is the global device id of replica r's pipeline rank k. Every
            device appears once.
        stage_costs: ``stage_costs[r][s]`` for replica r, global (virtual) stage s.
        static_memory_bytes: weights, gradients and optimizer states resident all step, per
            device (computed by the caller for the device's ZeRO level). Missing devices hold 0.
        comm: communication model; None means every transfer and collective takes zero time.
        peak_flops: dense peak FLOP/s per device, for MFU. Missing devices count 0.
        model_flops_per_step: model FLOPs of the whole step (all replicas), e.g. 6·N·tokens.
        tokens_per_step: tokens of the whole step (all replicas).
        collectives: answers for every UNSHARD/RESHARD/REDUCE_GRAD/OPTIM in the schedules;
            required when any schedule has one.
        tp_members: a rank run by a tensor-parallel group: its device in ``devices`` (the lead)
            -> the group's other devices, which run the same actions at the same times with the
            same memory; the result reports each of them as a copy of the lead.
        duration_overrides: seconds that replace what ``stage_costs`` and ``collectives`` give an
            action on the compute stream: device id (a lead, for a TP group) -> action (F, B, W,
            BW or OPTIM of that device's program) -> seconds; every occurrence of the action takes
            them. Communication (transfers, collectives) stays modelled. The fidelity study
            replays a measured step's compute this way (:mod:`medley.fidelity.replay`).
        start_s: when each device's program starts (device id, a lead for a TP group -> seconds
            >= 0; missing: 0): a replayed step's ranks start at the skew they were measured at.
    """

    schedules: list[PipelineSchedule]
    devices: list[list[int]]
    stage_costs: list[list[StageCost]]
    static_memory_bytes: dict[int, float] = field(default_factory=dict)
    comm: CommModel | None = None
    peak_flops: dict[int, float] = field(default_factory=dict)
    model_flops_per_step: float = 0.0
    tokens_per_step: float = 0.0
    collectives: CollectiveTable | None = None
    tp_members: dict[int, tuple[int, ...]] = field(default_factory=dict)
    duration_overrides: dict[int, dict[Action, float]] = field(default_factory=dict)
    start_s: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        replicas = len(self.schedules)
        if replicas == 0:
            raise ValueError("SimProblem.schedules is empty; give one schedule per DP replica")
        if len(self.devices) != replicas or len(self.stage_costs) != replicas:
            raise ValueError(
                f"SimProblem has {replicas} schedules but {len(self.devices)} device rows and "
                f"{len(self.stage_costs)} stage-cost rows; give one of each per replica"
            )
        seen: set[int] = set()
        for r, schedule in enumerate(self.schedules):
            if len(self.devices[r]) != schedule.num_ranks:
                raise ValueError(
                    f"replica {r}: devices[{r}] has {len(self.devices[r])} ids but the schedule has "
                    f"{schedule.num_ranks} ranks"
                )
            if len(self.stage_costs[r]) != schedule.num_stages:
                raise ValueError(
                    f"replica {r}: stage_costs[{r}] has {len(self.stage_costs[r])} entries but the "
                    f"schedule has {schedule.num_stages} stages"
                )
            for device in self.devices[r]:
                if device in seen:
                    raise ValueError(f"device {device} appears twice in SimProblem.devices")
                seen.add(device)
            if self.collectives is None and any(
                a.kind in _ZERO_KINDS for row in schedule.actions for a in row
            ):
                raise ValueError(
                    f"replica {r}'s schedule has ZeRO actions; SimProblem.collectives must say what they do"
                )
        for lead, members in self.tp_members.items():
            if lead not in seen:
                raise ValueError(f"SimProblem.tp_members names lead {lead}, which runs no rank")
            for device in members:
                if device in seen:
                    raise ValueError(f"device {device} appears twice in SimProblem.devices / tp_members")
                seen.add(device)
        if self.duration_overrides:
            self._check_overrides()
        leads = {device for row in self.devices for device in row}
        for device, start in self.start_s.items():
            if device not in leads or not start >= 0:
                raise ValueError(f"SimProblem.start_s: device {device} starts at {start}; give a rank's "
                                 "lead device a start >= 0")

    def _check_overrides(self) -> None:
        """Every overridden action is a compute-stream action of its device's program."""
        rows = {device: self.schedules[r].actions[k]
                for r, row in enumerate(self.devices) for k, device in enumerate(row)}
        for device, table in self.duration_overrides.items():
            if device not in rows:
                raise ValueError(f"SimProblem.duration_overrides names device {device}, which leads no "
                                 "rank (give a TP group's durations to its lead)")
            runs = {a for a in rows[device] if a.is_compute or a.kind is Kind.OPTIM}
            unknown = sorted(str(a) for a in table if a not in runs)
            if unknown:
                raise ValueError(f"SimProblem.duration_overrides: device {device} runs no compute "
                                 f"action {', '.join(unknown[:5])}")
            negative = sorted(str(a) for a, seconds in table.items() if not seconds >= 0)
            if negative:
                raise ValueError(f"SimProblem.duration_overrides: device {device} gives "
                                 f"{', '.join(negative[:5])} a duration below 0")


_ZERO_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD, Kind.OPTIM, Kind.CLIP})
