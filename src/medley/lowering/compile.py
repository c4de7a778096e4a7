"""Compile a plan (devices, split, schedule, ZeRO per stage) into the simulator's input.

This is where layers, device types and bytes become seconds: per-stage F/B/W times from the cost
source, activation and boundary bytes from the formulas, model-state memory from the ZeRO model,
and what every UNSHARD/RESHARD/REDUCE_GRAD/OPTIM does from the stage's DP group and level.

Tensor parallelism (``layout.tp``): a pipeline rank's TP group runs one timeline, simulated on
its first device (the lead; the members run the same actions at the same times and hold the same
bytes, so the simulator reports them as copies, :attr:`SimProblem.tp_members`). Its compute
actions take one TP rank's compute plus the blocks' TP all-reduces over the group
(:mod:`medley.cost.tp_cost`); its memory is one TP rank's (split matrices and split
activations, replicated norms, embedding and head). Its ZeRO collectives run once per TP rank,
each over that rank's DP group (the same TP rank of the other replicas) on 1/tp of the split
parameters; the simulator times the lead's group. How the tp groups share links, and how
pipeline transfers between groups of different tp are timed: :mod:`medley.lowering.tp_links`. Under
sequence parallelism (``layout.sequence_parallel``) the blocks' collectives are all-gathers and
reduce-scatters, a stage's edges add the all-gathers :func:`~medley.cost.tp_cost.sequence_edge_time`
names, and the activations the sequence cuts are held 1/tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from medley.cost import formulas
from medley.cost.comm import TopologyCommModel
from medley.cost.formulas import DTYPE_BYTES
from medley.cost.interfaces import Collective, CommModel, CostSource, Pass
from medley.cost.recompute import rerun_share
from medley.cost.tp_cost import (
    TensorParallelCompute,
    TensorPricing,
    activation_scale,
    sequence_edge_time,
    tp_activation_bytes,
    tp_all_reduce_bytes,
    tp_comm_time,
)
from medley.cost.zero_levels import fsdp_units
from medley.cost.zero_memory import StageStateBytes, adapted_state_bytes, state_bytes_per_param
from medley.lowering.activations import (
    autocast_copies,
    boundary_bytes,
    layer_bytes,
    layer_bytes_after_b,
    stage_modes,
)
from medley.lowering.collectives import CollectiveTable, unit_params, unit_trained
from medley.lowering.tp_links import scale_hops
from medley.plan.layout import PlanLayout, sequence_sharded_edges
from medley.plan.world import build_world, step_actions
from medley.schedule.ir import Kind, PipelineSchedule
from medley.sim.problem import SimProblem, StageCost
from medley.spec.cluster import Cluster
from medley.spec.limits import check_sim_actions


def _stage_cost(
    layout: PlanLayout,
    cost: CostSource,
    stage: int,
    device_type: str,
    level: int,
    *,
    tensor: TensorParallelCompute,
    fused: bool = False,
    comm: CommModel | None = None,
    group: tuple[int, ...] = (),
) -> StageCost:
    """One stage's times and bytes per micro-batch. ``fused``: the schedule runs BW, not B and W.

    On a TP group (``group`` of more than one device) the times are one TP rank's compute
    (``tensor``) plus the blocks' TP all-reduces on ``comm``, and the bytes one rank's.

    Measured sources (profiles: :class:`~medley.cost.interfaces.CostSource`) also give the fused
    backward time and activation bytes; the formulas answer otherwise. The first stage's input
    (token ids) takes no gradient, so its split backward does everything at W, as torch and
    medley's runtime do. A measured source may also give the runtime executor's cost per compute
    action (``action_overhead_time``, see :mod:`medley.profile.overhead`), added once to each.
    """
    mbs, seq, model = layout.micro_batch_size, layout.seq_len, layout.model
    tp = max(1, len(group))
    recompute = layout.stage_recompute(stage)
    modes = stage_modes(layout, stage)
    times = {kind: 0.0 for kind in Pass}
    act = after_b = fused_s = refwd = rerun_comm = frozen_w = 0.0
    fused_known = measured_act = True
    freed: dict[int, float] = {}  # layer -> what its backward frees of one micro-batch's activations
    measured_layers: list[bool] = []  # per layer: whether its activation bytes were measured
    full_time = cost.backward_full_time
    fsdp_time = cost.fsdp_extra_time if fsdp_units(level, layout.zero_dp) else None
    fsdp = {kind: 0.0 for kind in Pass}
    measured_bytes = cost.activation_bytes
    overhead = cost.action_overhead_time(device_type=device_type) or 0.0
    at = {"micro_batch_size": mbs, "seq_len": seq, "device_type": device_type}
    tp_comm = {kind: 0.0 for kind in Pass}  # TP collectives and DTensor's dispatch (measured sources)
    dtensor_time = cost.tp_extra_time if tp > 1 else None
    sp = layout.sequence_parallel and tp > 1
    edges = sequence_sharded_edges(layout)
    has_block = any(model.layer_kind(i) == "block" for i in layout.layer_range(stage))
    if sp and has_block:  # a whole input cut to shards, a whole output gathered from them
        nbytes = tp_all_reduce_bytes(model, micro_batch_size=mbs, seq_len=seq, dtype=layout.dtype)
        for kind in (Pass.F, Pass.B):
            tp_comm[kind] += sequence_edge_time(comm, group, nbytes, kind, whole_input=stage - 1 not in edges,
                                                whole_output=stage not in edges)
    for layer in layout.layer_range(stage):
        block = model.layer_kind(layer) == "block"
        mode = modes[layer]
        for kind in Pass:
            seconds = tensor.layer_time(layer, kind, tp=tp, **at)
            times[kind] += seconds
            if kind is Pass.W:  # a frozen weight (a LoRA run's base) takes no gradient
                frozen_w += seconds * (1.0 - formulas.weight_grad_share(model, layout.adapter, layer, tp=tp))
            comm_s = tp_comm_time(comm, model, layer, kind, group=group, micro_batch_size=mbs,
                                  seq_len=seq, dtype=layout.dtype, sequence_parallel=sp)
            if dtensor_time is not None and block:
                comm_s += dtensor_time(layer, kind, **at) or 0.0
            tp_comm[kind] += comm_s
            if kind is Pass.F and mode != "none":
                # Recomputing blocks (not embedding or head) run their forward again: all of it, or
                # (selective) its memory-bound share; either way with its TP all-reduces (the
                # selective policy saves no collective's output).
                share = tensor.catalog.cheap_share(layer, tp=tp, **at) if mode == "selective" else 0.0
                refwd += rerun_share(mode, forward_s=seconds, cheap_s=seconds * share)
                rerun_comm += comm_s
            if fsdp_time is not None:
                extra = fsdp_time(layer, kind, **at)
                fsdp[kind] += (extra or 0.0) * (tensor.scale(kind, tp=tp, **at) if block else 1.0)
        full = full_time(layer, **at)
        fused_known = fused_known and full is not None
        if full is not None:
            back = tensor.scale(Pass.B, tp=tp, **at) + tensor.scale(Pass.W, tp=tp, **at)
            fused_s += full.seconds * (back / 2 if block else 1.0)
        found = None
        # Recomputing blocks keep what their mode keeps (a formula); embedding and head do not recompute.
        if mode == "none":
            found = measured_bytes(layer, **at)
        measured_act = measured_act and found is not None
        measured_layers.append(found is not None)
        shape = {"micro_batch_size": mbs, "seq_len": seq}
        held = tp_activation_bytes(model, layer, found, dtype=layout.dtype, tp=tp, sequence_parallel=sp,
                                   **shape) if found else None
        layer_act = held[0] if held else layer_bytes(layout, layer, mode=mode, tp=tp)
        layer_after_b = held[1] if held else layer_bytes_after_b(layout, layer, tp=tp)
        act, after_b = act + layer_act, after_b + layer_after_b
        freed[layer] = layer_act if fused else max(0.0, layer_act - layer_after_b)
    boundary = boundary_bytes(layout)
    first = layout.layer_range(stage).start == 0
    # Measured layers count what their forward adds (their output, not their input), the formulas a
    # layer's input (not its output): where a measured layer starts a stage past the first or
    # follows a formula's layer (a recomputing block), its input is held on top; where a formula's
    # layer follows a measured one, that input was counted twice. Under sequence parallelism a
    # block's input inside a stage is a sequence shard (the head's is whole: the last block gathers
    # it), and so is a received input that crossed as one.
    layers = layout.layer_range(stage)
    prev: bool | None = None if first else False
    for index, measured_layer in enumerate(measured_layers):
        if prev is not None and measured_layer != prev:
            sharded = sp and (model.layer_kind(layers[index]) == "block" if index > 0 else stage - 1 in edges)
            piece = boundary / tp if sharded else boundary
            act, after_b = act + (piece if measured_layer else -piece), after_b + (
                piece if measured_layer else -piece)
        prev = measured_layer
    # Autocast's copies of the fp32 weights, which each forward keeps for its backward (half
    # precision without FSDP2; a recomputing block keeps none). The matmuls' autograd nodes hold
    # them until they are released, so a split backward frees them at W, not at B.
    copies = autocast_copies(layout, stage, modes, tp=tp)
    act, after_b = act + copies, after_b + copies
    scale = 1.0
    if fused and fused_known and times[Pass.B] + times[Pass.W] > 0:
        scale = fused_s / (times[Pass.B] + times[Pass.W])  # one autograd call costs less than two
        times[Pass.B], times[Pass.W] = times[Pass.B] * scale, times[Pass.W] * scale
    times[Pass.W] -= frozen_w * scale
    if recompute:
        # The forward (with its TP all-reduces) runs again inside each backward call that needs the
        # blocks' activations: torch's non-reentrant checkpoint recomputes once per call, so split
        # B and W each pay it (the first stage's split backward is one call, at W).
        reruns = (Pass.B,) if fused or first else (Pass.B, Pass.W)
        for kind in reruns:
            times[kind] += refwd
            tp_comm[kind] += rerun_comm
    for kind in Pass:  # FSDP2's hooks on ZeRO-2/3 stages (measured sources only), TP all-reduces
        times[kind] += fsdp[kind] + tp_comm[kind]
    if first and not fused:
        times[Pass.W], times[Pass.B] = times[Pass.W] + times[Pass.B], 0.0
        after_b = act
    # The executor's bookkeeping, once per compute action: F, and B and W (BW counts B + W, so the
    # fused backward carries it once).
    times[Pass.F] += overhead
    times[Pass.B] += overhead
    if not fused:
        times[Pass.W] += overhead
    # The stage's whole unsharded gradient, made by its backward (not kept between steps).
    gradient = _stage_state(layout, stage).gradient
    return StageCost(
        forward_s=times[Pass.F],
        backward_input_s=times[Pass.B],
        backward_weight_s=times[Pass.W],
        activation_bytes=act,
        activation_after_b_bytes=min(after_b, act) if not measured_act else after_b,
        send_bytes=boundary,
        grad_buffer_bytes=gradient,
        workspace_bytes=backward_workspace(layout, cost, stage, device_type, freed=freed),
    )


def _stage_state(layout: PlanLayout, stage: int) -> StageStateBytes:
    """Model-state bytes per device of ``stage`` (:func:`medley.lowering.collectives.unit_params` of its
    layers, adapters included, of which :func:`~medley.lowering.collectives.unit_trained` train)."""
    layers = layout.layer_range(stage)
    return adapted_state_bytes(unit_params(layout, stage, layers.start, layers.stop),
                               trained=unit_trained(layout, stage, layers.start, layers.stop),
                               level=layout.zero[stage].level, dp=layout.zero_dp,
                               per_param=state_bytes_per_param(layout.dtype))


def static_memory(layout: PlanLayout, stage_to_rank: Sequence[int]) -> dict[int, float]:
    """Model state resident all step, per device (:func:`medley.cost.zero_memory.stage_state_bytes`:
    weights, FSDP2's shards, optimizer state); the gradient autograd makes, its shard, ZeRO-3's
    gathered weights and the backward's workspace are the simulator's to add and free."""
    out: dict[int, float] = {}
    for stage in range(layout.num_stages):
        state = _stage_state(layout, stage)
        for replica in range(layout.dp):
            for device in layout.group(replica, stage_to_rank[stage]):  # every TP rank holds the same
                out[device] = out.get(device, 0.0) + state.resident
    return out


def backward_workspace(
    layout: PlanLayout, cost: CostSource | None, stage: int, device_type: str, *,
    freed: dict[int, float] | None = None,
) -> float:
    """Bytes a backward of ``stage`` holds beyond the activations it starts with, at its largest
    layer: the temporaries and gradients of intermediates a measured source knows per layer, and
    a recomputing block's whole forward activations held again (:func:`recompute_workspace`), less
    what the layers after it (run backward first) have freed by then (``freed``: per layer, the
    activation bytes of one micro-batch its backward lets go)."""
    measured = None if cost is None else cost.workspace_bytes
    modes = stage_modes(layout, stage)
    tp = layout.stage_tp(stage)
    sp = layout.sequence_parallel and tp > 1
    shape = {"micro_batch_size": layout.micro_batch_size, "seq_len": layout.seq_len}
    freed = freed or {}
    most = gone = 0.0
    for layer in reversed(layout.layer_range(stage)):
        more = -gone
        if measured is not None:
            shrink = activation_scale(layout.model, layer, dtype=layout.dtype, tp=tp, sequence_parallel=sp,
                                      **shape)[0]
            more += (measured(layer, device_type=device_type, **shape) or 0.0) * shrink
        if modes[layer] != "none":
            more += recompute_workspace(layout, cost, layer, device_type, tp=tp, mode=modes[layer])
        most = max(most, more)
        gone += freed.get(layer, 0.0)
    return most


def recompute_workspace(
    layout: PlanLayout, cost: CostSource | None, layer: int, device_type: str, *, tp: int = 1,
    mode: str = "full",
) -> float:
    """Bytes a recomputing block holds again during its backward: its forward's activations
    (measured where the source knows them, scaled to one of ``tp`` TP ranks), beyond what it
    kept under ``mode`` that the rerun saves again (:func:`medley.cost.formulas.layer_rerun_bytes`);
    0 for other layers."""
    model, mbs, seq = layout.model, layout.micro_batch_size, layout.seq_len
    if model.layer_kind(layer) != "block":
        return 0.0
    sp = layout.sequence_parallel and tp > 1
    found = (None if cost is None else
             cost.activation_bytes(layer, micro_batch_size=mbs, seq_len=seq, device_type=device_type))
    dtype_bytes = DTYPE_BYTES[layout.dtype]
    shape = {"micro_batch_size": mbs, "seq_len": seq}
    full = (tp_activation_bytes(model, layer, found, dtype=layout.dtype, tp=tp, sequence_parallel=sp,
                                **shape)[0] if found else None)
    return formulas.layer_rerun_bytes(model, layer, dtype_bytes=dtype_bytes, recompute=mode, tp=tp,
                                      sequence_parallel=sp, full_bytes=full, **shape)


def compile_problem(
    layout: PlanLayout, cluster: Cluster, cost: CostSource, *, comm: bool = True, where: str | None = None
) -> SimProblem:
    """The :class:`SimProblem` of one training step of ``layout`` on ``cluster`` (``where``: as
    for :func:`compile_world`)."""
    return compile_world((layout,), cluster, cost, comm=comm, where=where)


def compile_world(
    groups: Sequence[PlanLayout], cluster: Cluster, cost: CostSource, *, comm: bool = True,
    where: str | None = None, pricing: TensorPricing | None = None,
) -> SimProblem:
    """The :class:`SimProblem` of one training step of the plan made of replica ``groups``
    (:mod:`medley.plan.segments`): each group's replicas as above, their ZeRO collectives over the
    plan's sync segments (:class:`~medley.lowering.collectives.CollectiveTable`). With ``where`` (the
    input the plan came from), a step of more actions than the simulator runs in seconds
    (:func:`medley.spec.limits.check_sim_actions`) is refused before anything per replica is built.
    ``pricing``: the caller's TP pricing of this cluster and source (a search passes its one), else
    one made here."""
    world = build_world(groups)
    if where is not None:
        check_sim_actions(step_actions(world.schedules), where=where)
    model = world.groups[0].model
    pricing = pricing or TensorPricing(model, cost, cluster)
    tensor = pricing.of(world.groups[0].dtype)
    links = TopologyCommModel(cluster, p2p_overhead_s=_p2p_overhead(cost)) if comm else None
    stage_costs: list[list[StageCost]] = []
    devices: list[list[int]] = []
    static: dict[int, float] = {}
    members: dict[int, tuple[int, ...]] = {}
    for g, layout in enumerate(world.groups):
        schedules = world.schedules_of(g)
        stage_costs += _group_costs(layout, cluster, cost, schedules[0], tensor, links)
        devices += [list(row) for row in layout.assignment]
        for device, held in static_memory(layout, schedules[0].stage_to_rank).items():
            static[device] = static.get(device, 0.0) + held
        members.update({grp[0]: grp[1:] for r in range(layout.dp) for k in range(layout.pp)
                        if len(grp := layout.group(r, k)) > 1})
    first = world.groups[0]
    sequences = sum(sum(layout.micro_batches) for layout in world.groups) * first.micro_batch_size
    used = [d for layout in world.groups for d in layout.devices]
    return SimProblem(
        schedules=list(world.schedules),
        devices=devices,
        stage_costs=stage_costs,
        static_memory_bytes=static,
        comm=links,
        tp_members=members,
        peak_flops={d: cluster.devices[d].type.peak_flops(first.dtype) for d in used},
        model_flops_per_step=formulas.megatron_flops_per_step(model, batch_size=sequences,
                                                              seq_len=first.seq_len),
        tokens_per_step=float(sum(layout.tokens_per_step for layout in world.groups)),
        collectives=CollectiveTable(world, cluster, cost),
    )


def _group_costs(layout: PlanLayout, cluster: Cluster, cost: CostSource, schedule: PipelineSchedule,
                 tensor: TensorParallelCompute, links: TopologyCommModel | None) -> list[list[StageCost]]:
    """``costs[r][s]``: the stage costs of each replica of one group."""
    s2r = schedule.stage_to_rank
    split = {a.stage for row in schedule.actions for a in row if a.kind in (Kind.B, Kind.W)}
    fused = [stage not in split for stage in range(layout.num_stages)]
    stage_costs = []
    # Replicas whose stage runs on one device type and an equal TP group cost alike: compute each
    # once (a copy per replica, as scale_hops rescales its transfers in place).
    known: dict[tuple, StageCost] = {}
    all_reduce = tp_all_reduce_bytes(layout.model, micro_batch_size=layout.micro_batch_size,
                                     seq_len=layout.seq_len, dtype=layout.dtype)
    for replica in range(layout.dp):
        row = []
        for stage in range(layout.num_stages):
            group = layout.group(replica, s2r[stage])
            device = cluster.devices[group[0]]
            # What the cost reads of the group beyond its size: the time of its all-reduces.
            tp_link = len(group) > 1 and links is not None
            link = links.collective_time(Collective.ALL_REDUCE, group, all_reduce) if tp_link else 0.0
            key = (stage, device.type.name, len(group), link)
            if key not in known:
                known[key] = _stage_cost(layout, cost, stage, device.type.name, layout.zero[stage].level,
                                         fused=fused[stage], tensor=tensor, comm=links, group=group)
            row.append(replace(known[key]))
        scale_hops(layout, cluster, replica, s2r, row, links)
        stage_costs.append(row)
    return stage_costs


def _p2p_overhead(cost: CostSource) -> float:
    """The runtime's hand-off per point-to-point transfer, from a measured source (else 0)."""
    return cost.p2p_overhead_time() or 0.0
