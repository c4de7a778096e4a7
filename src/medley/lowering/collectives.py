"""What every ZeRO action of a plan does, for the simulator: its group, bytes, memory and time.

A collective action of a stage's bucket is a collective of one sync-segment unit
(:mod:`medley.plan.segments`): its group is the unit's holders (the lead device of each, in global
replica order; the other TP ranks' groups run the same collective at once on their slices), its
bytes those of the unit's layers, and what it does the stage's ZeRO level
(:mod:`medley.cost.zero_levels`), sharded over every replica of the plan. ``CollectiveCost.unit``
names the unit, so that holders at unlike stages of unlike replicas meet in one collective.
"""

from __future__ import annotations

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.interfaces import Collective, CostSource
from medley.cost.tied_cost import tied_sum_seconds
from medley.cost.zero_levels import Payload, fsdp_units, zero_level
from medley.cost.zero_memory import adapted_state_bytes, state_bytes_per_param
from medley.lowering.tp_links import dp_bytes_factor
from medley.plan.layout import PlanLayout
from medley.plan.world import World
from medley.schedule.ir import Action, Kind
from medley.sim.problem import CollectiveCost
from medley.spec.cluster import Cluster

# Adam reads and writes fp32 master weights, momentum and variance (24 B), reads the gradient and
# writes the half-precision weight (4 B): the step is bound by memory bandwidth.
OPTIMIZER_STEP_BYTES_PER_PARAM = 28.0


def unit_params(layout: PlanLayout, stage: int, first: int, stop: int) -> float:
    """Parameters each device of ``stage``'s TP group holds for its layers ``[first, stop)`` (a
    bucket): a tied head keeps its own copy only on a stage without the embedding
    (:func:`medley.cost.formulas.stage_held_params`)."""
    model, tp = layout.model, layout.stage_tp(stage)
    held = sum(formulas.layer_held_params(model, i, tp=tp) for i in range(first, stop))
    borrowed = model.tied_embeddings and layout.layer_range(stage).start == 0 and stop == model.num_layers
    adapters = unit_trained(layout, stage, first, stop) or 0.0
    return held - (model.vocab_size * model.embed_dim if borrowed else 0) + adapters


def unit_trained(layout: PlanLayout, stage: int, first: int, stop: int) -> float | None:
    """Of :func:`unit_params`, the ones that train: a LoRA layout's adapters; None: all of them."""
    if layout.adapter is None:
        return None
    return formulas.stage_adapter_params(layout.model, layout.adapter, first, stop, tp=layout.stage_tp(stage))


class CollectiveTable:
    """``table(replica, action)``: what that replica's collective action does
    (:data:`medley.sim.problem.CollectiveTable`). Answers are kept per group, stage and bucket
    (and per device type for OPTIM), so the table's work grows with the stages, not the replicas."""

    def __init__(self, world: World, cluster: Cluster, cost: CostSource | None = None) -> None:
        self.world, self.cluster = world, cluster
        self.state = state_bytes_per_param(world.groups[0].dtype)
        self.optimizer_time = None if cost is None else cost.optimizer_time
        # The runtime's work around each gather or reduction call (measured sources only).
        self.call_overhead = 0.0 if cost is None else (cost.collective_overhead_time() or 0.0)
        self.comm = TopologyCommModel(cluster)
        self._devices: dict[int, tuple[int, ...]] = {}
        self._cache: dict[tuple, CollectiveCost] = {}
        self._clip: CollectiveCost | None = None

    def __call__(self, replica: int, action: Action) -> CollectiveCost:
        if action.kind is Kind.CLIP:
            if self._clip is None:
                self._clip = self._clip_cost()
            return self._clip
        group, local = self.world.segments.where(replica)
        key: tuple = (group, action.kind, action.stage, action.bucket)
        if action.kind is Kind.OPTIM:
            layout = self.world.groups[group]
            device = layout.assignment[local][self.world.schedules[replica].stage_to_rank[action.stage]]
            key += (self.cluster.devices[device].type.name,)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._cost(group, local, action)
        return found

    def unit_devices(self, segment: int) -> tuple[int, ...]:
        """The lead device of each holder of ``segment``, in global replica order."""
        found = self._devices.get(segment)
        if found is None:
            holders = self.world.segments.segments[segment].holders
            firsts, groups = self.world.segments.first_replica, self.world.groups
            found = self._devices[segment] = tuple(
                groups[h.group].assignment[h.replica - firsts[h.group]][h.pipeline_rank] for h in holders)
        return found

    def _clip_cost(self) -> CollectiveCost:
        """One fp64 partial squared norm per rank, summed world-wide; the CLIP also waits for the
        tied embeddings' gradient sum (a plan of alike replicas only)."""
        world = tuple(sorted(d for layout in self.world.groups for row in layout.assignment for d in row))
        tied = 0.0
        if len(self.world.groups) == 1:
            layout = self.world.groups[0]
            tied = tied_sum_seconds(self.comm, model=layout.model, assignment=layout.assignment,
                                    stage_to_rank=self.world.schedules[0].stage_to_rank,
                                    grad_bytes=self.state.grads, zero=[z.level for z in layout.zero])
        return CollectiveCost(group=world, op=Collective.ALL_REDUCE, nbytes=8.0, compute_s=tied)

    def _cost(self, group_index: int, local: int, action: Action) -> CollectiveCost:
        layout, stage = self.world.groups[group_index], action.stage
        segments = self.world.segments
        stage_units = segments.units[group_index][stage]
        unit = segments.unit(group_index, stage, action.bucket)
        group = self.unit_devices(unit[0])
        params, trained = self._bucket_params(layout, stage, unit)  # what gathers carry
        stepped = params if trained is None else trained  # what reductions carry and OPTIM steps
        layers = layout.layer_range(stage)
        stage_params = unit_params(layout, stage, layers.start, layers.stop)
        stage_trained = unit_trained(layout, stage, layers.start, layers.stop)
        # Memory follows the planner's model (medley.search.estimate.bounds.stage_memory): a bucket holds its
        # share of the stage's layers of the stage's state.
        share = segments.segments[unit[0]].buckets[unit[1]] / len(layers)
        held = stage_params * share
        # The other TP ranks' DP groups run the same collective at once (medley.lowering.compile).
        wire = dp_bytes_factor(self.cluster, group, layout.stage_tp(stage))
        meaning = zero_level(layout.zero[stage].level)
        op, payload = meaning.collective(action.kind)
        per_param = self.state.weights if payload is Payload.WEIGHTS else self.state.grads
        level, dp = layout.zero[stage].level, layout.zero_dp
        sharded = fsdp_units(level, dp)
        state = adapted_state_bytes(held, trained=None if stage_trained is None else stage_trained * share,
                                    level=level, dp=dp, per_param=self.state)  # the bucket's
        common = {"group": group, "unit": unit}
        if action.kind in (Kind.UNSHARD, Kind.RESHARD):
            # Level 3 gathers the bucket whole (next to the shard), and every bucket of the stage
            # before a compute action (streamed or not: the schedule's UNSHARDs all precede the
            # F or BW, whose one autograd call needs every layer); levels 1-2 refresh weights
            # that stay gathered all step.
            gathered = state.gathered_weights
            if action.kind is Kind.RESHARD:
                return CollectiveCost(op=None, free_bytes=gathered, **common)
            return CollectiveCost(op=op, nbytes=params * per_param * wire, alloc_bytes=gathered,
                                  compute_s=self.call_overhead, **common)
        if action.kind is Kind.REDUCE_GRAD:
            # Levels 1-3 free the bucket's unsharded gradient and make its shard; level 0 keeps
            # the flat buffer as the reduced gradient, freeing the gradient it came from
            # (zero_memory's table). Levels 1-3's reduce-scatter input stays until the next
            # reduction: one bucket's, booked on the stage's first (its last bucket) at the
            # largest bucket's size. Allocations are booked until the end of the step (a
            # reduction frees at most the gradient still live, see SimProblem).
            freed = buffer = 0.0
            if dp > 1:
                freed = state.gradient
                buffer = state.grad_shard if sharded else freed
                if sharded and action.bucket in (None, len(stage_units) - 1):
                    largest = max(segments.segments[seg].buckets[i] for seg, i in stage_units) / len(layers)
                    buffer += adapted_state_bytes(stage_params, trained=stage_trained, level=level, dp=dp,
                                                  per_param=self.state, bucket_fraction=largest).reduce_buffer
            return CollectiveCost(op=op, nbytes=stepped * per_param * wire, free_bytes=freed,
                                  alloc_bytes=buffer, compute_s=self.call_overhead, **common)
        rank = self.world.schedules[segments.first_replica[group_index] + local].stage_to_rank[stage]
        device = self.cluster.devices[layout.assignment[local][rank]].type
        shard = stepped / dp if meaning.shards_optimizer else stepped
        measured = self.optimizer_time(shard, device_type=device.name) if self.optimizer_time else None
        if measured is not None:
            step_s = measured.seconds
        else:
            step_s = shard * OPTIMIZER_STEP_BYTES_PER_PARAM / (device.memory_bandwidth_gbps * 1e9)
        return CollectiveCost(op=None, compute_s=step_s, **common)

    def _bucket_params(self, layout: PlanLayout, stage: int,
                       unit: tuple[int, int]) -> tuple[float, float | None]:
        segment = self.world.segments.segments[unit[0]]
        first = segment.first + sum(segment.buckets[:unit[1]])
        stop = first + segment.buckets[unit[1]]
        return unit_params(layout, stage, first, stop), unit_trained(layout, stage, first, stop)
