"""Run one rank's action list from medley's IR, exactly in the order given.

Per action: ``F`` forward (the last stage also applies the loss), ``BW`` full backward, ``B`` the
input-gradient half and ``W`` the weight-gradient half of a split backward, ``SEND_*``/``RECV_*``
point-to-point transfers to the global ranks of the peer stage's TP group (each run of consecutive
transfers posted as one ``batch_isend_irecv``, untagged: NCCL matches a rank pair's messages by
their order, which the lowering keeps, :mod:`medley.schedule.messages`; a RECV posts the receive
and the consuming compute action waits for it; between TP groups of unlike degrees receiving TP
rank j takes the tensor from sending TP rank ``tp_sources(...)[j]``, forward and backward alike,
:func:`medley.plan.layout.tp_sources`; between TP groups of one degree t > 1 rank j sends slice j of
t and the receiving group all-gathers the slices in the compute action that uses the tensor,
:func:`medley.plan.layout.tp_scattered`; under sequence parallelism an edge of
:func:`medley.plan.layout.sequence_sharded_edges` carries each rank's sequence shard as it is, no
gather), and the ZeRO collectives of
:mod:`medley.runtime.sharding`. Adjacent stages on the same rank hand activations and gradients
over in memory. Nothing happens that the list does not say, so every member of a DP group issues
the collectives the schedule placed, in the same order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from medley.data.source import MicroBatches
from medley.runtime.hops import Hops
from medley.runtime.sends import PendingSends
from medley.runtime.sharding import ShardedStage
from medley.runtime.torch_adapter import all_gather_single, backward_input, backward_weight
from medley.schedule.ir import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    P2P_KINDS,
    Action,
    Kind,
    PipelineSchedule,
    p2p_peer_stage,
)
from medley.schedule.messages import SEND_KINDS, message_key, transfer_runs

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# What a rank's step time goes to, by the kind of action it was in (``RankExecutor.action_s``).
ACTION_CATEGORIES: tuple[str, ...] = ("compute", "transfer", "zero", "optim", "clip")
_CATEGORY = {**dict.fromkeys(COMPUTE_KINDS, "compute"), **dict.fromkeys(P2P_KINDS, "transfer"),
             **dict.fromkeys(COLLECTIVE_KINDS - {Kind.OPTIM, Kind.CLIP}, "zero"), Kind.OPTIM: "optim",
             Kind.CLIP: "clip"}
# The actions of a forward-only pass (evaluation): the forwards, their transfers, and the ZeRO-3
# gathers and releases around them, in the schedule's order.
FORWARD_KINDS = frozenset({Kind.UNSHARD, Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.RESHARD})


@dataclass(kw_only=True)
class StageState:
    """Per-step tensors of one stage, keyed by micro-batch."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    weight_state: dict[int, object] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


class RankExecutor:
    """Executes a rank's program of one replica's schedule, step after step.

    Args:
        schedule: the replica's schedule (with P2P and collective actions already placed).
        pipeline_rank: this rank's index inside the replica.
        stages: this rank's stages by global stage index.
        pipeline: the global ranks of each pipeline rank of the replica, in TP rank order
            (``RankGroups.pipeline``); transfers go over the world group to these ranks.
        tp_rank: this rank's place in its TP group.
        activation_shape: [micro_batch_size, seq, hidden] of the tensors passed between stages.
        loss_fn: summed loss of one micro-batch from logits and targets (``token_loss_sum``); the
            executor divides it by the global batch's ``MicroBatches.loss_tokens``.
        dtype: dtype of the activations and gradients passed between stages (the compute dtype;
            each side casts to and from it).
        autocast_dtype: run forwards under ``torch.autocast`` in this dtype (bf16 compute on fp32
            master weights); None computes in the weights' dtype.
        slowdown: emulation of a slower device: after each compute action the rank sleeps
            ``(slowdown - 1) x`` the time the action took (1.0: no emulation).
        on_clip: runs the schedule's CLIP action (the world-wide gradient-norm all-reduce and
            the clip); the schedule puts every OPTIM of the rank behind it.
        before_optim: called with (stage, bucket) right before each optimizer step runs.
        before_clip: called at the CLIP action before ``on_clip`` (the tied embeddings' gradient
            sum, :mod:`medley.runtime.tied`).
        device: where activations live (receive buffers are allocated there).
        synced_stages: the stages whose TP group meets in all-reduces in each forward and backward
            (blocks on more than one device): what lets a send to a TP group be released once
            another member of it answered (:class:`~medley.runtime.sends.PendingSends`).
        tp_group: this rank's TP group, where the slices of a scattered hop are all-gathered
            (:func:`~medley.plan.layout.tp_scattered`); needed when this rank's TP degree is above
            1 and a neighbouring pipeline rank has the same degree.
        sequence_edges: stages whose output crosses to the next stage as each TP rank's sequence
            shard (:func:`~medley.plan.layout.sequence_sharded_edges`): those transfers (and the
            gradients back) are ``[micro_batch_size, seq / tp, hidden]``, sent and used as they are.

    Two attributes steer fp16 runs (:mod:`medley.runtime.precision`): ``loss_scale`` multiplies
    each loss before its backward (the reported losses stay unscaled), and ``skip_optim``, set
    during a step (by ``on_clip``, once the world found a non-finite gradient), turns the step's
    OPTIM actions into dropping the gradients. ``skip_optim`` is reset at the start of each step.

    ``action_s`` holds the wall time this rank spent in each :data:`ACTION_CATEGORIES` of action
    during the last program run: ``compute`` (F/B/W/BW, emulation sleeps included),
    ``transfer`` (posting sends, waiting on receives), ``zero`` (the ZeRO collectives), ``optim``
    and ``clip``; the fidelity study sets them against the simulator's parts. It is wall time on
    the host: on CUDA, where kernels run asynchronously, it counts their launches only.
    ``action_spans`` holds, for the same run, each action's (start, end) seconds since the program
    started (``action_origin``, on ``time.perf_counter``'s clock: CLOCK_MONOTONIC on Linux, one
    clock for every process of the machine), in program order; the fidelity study replays a
    step's compute durations in the simulator (:mod:`medley.fidelity.replay`).
    """

    def __init__(self, *, schedule: PipelineSchedule, pipeline_rank: int, stages: dict[int, ShardedStage],
                 pipeline: Sequence[Sequence[int]], activation_shape: Sequence[int], loss_fn: LossFn,
                 dtype: torch.dtype = torch.float32, autocast_dtype: torch.dtype | None = None,
                 slowdown: float = 1.0, on_clip: Callable[[], None] | None = None,
                 before_optim: Callable[[int, int | None], None] | None = None,
                 before_clip: Callable[[], None] | None = None, device: torch.device | None = None,
                 tp_rank: int = 0, synced_stages: frozenset[int] = frozenset(),
                 tp_group: dist.ProcessGroup | None = None,
                 sequence_edges: frozenset[int] = frozenset()) -> None:
        self.schedule = schedule
        self.rank = pipeline_rank
        self.stages = stages
        self.pipeline = tuple(tuple(group) for group in pipeline)
        self.tp_rank = tp_rank
        self.activation_shape = tuple(activation_shape)
        self.loss_fn = loss_fn
        self.dtype = dtype
        self.autocast_dtype = autocast_dtype
        self.slowdown = slowdown
        self.on_clip = on_clip
        self.before_optim = before_optim
        self.before_clip = before_clip
        self.device = device or torch.device("cpu")
        self.emulated_sleep_s = 0.0
        self.action_s = dict.fromkeys(ACTION_CATEGORIES, 0.0)
        self.action_spans: list[tuple[float, float]] = []
        self.action_origin = 0.0
        self.loss_scale = 1.0
        self.skip_optim = False
        self.state: dict[int, StageState] = {}
        # Posted receives not yet waited for: RECV action -> (work, buffer, source rank).
        self.receiving: dict[Action, tuple[dist.Work, torch.Tensor, int]] = {}
        self.synced_stages = synced_stages
        self.tp_group = tp_group
        self.hops = Hops(pipeline=self.pipeline, stage_to_rank=schedule.stage_to_rank, rank=pipeline_rank,
                         tp_rank=tp_rank, local_stages=frozenset(stages), sequence_edges=sequence_edges,
                         activation_shape=self.activation_shape)
        self.pending_sends = self._pending_sends()

    @property
    def program(self) -> list[Action]:
        return self.schedule.actions[self.rank]

    @property
    def carries_clip(self) -> bool:
        """Whether this rank's program has the ``CLIP`` action (every rank's has, or none)."""
        return any(action.kind is Kind.CLIP for action in self.program)

    def run_step(self, batch: MicroBatches) -> list[torch.Tensor]:
        """Run the program once; returns the last stage's per-micro-batch losses (if held here)."""
        return self._run_program(self.program, batch)

    def run_forward(self, batch: MicroBatches) -> list[torch.Tensor]:
        """The program's forward actions only (:data:`FORWARD_KINDS`, in order, without autograd):
        the losses of ``batch`` under the current weights, nothing updated. Every rank drops the
        same kinds, so the DP group's collectives still match."""
        with torch.no_grad():
            return self._run_program([a for a in self.program if a.kind in FORWARD_KINDS], batch)

    def _run_program(self, program: list[Action], batch: MicroBatches) -> list[torch.Tensor]:
        self.state = {stage: StageState() for stage in self.stages}
        self.receiving = {}
        self.skip_optim = False
        self.action_s = dict.fromkeys(ACTION_CATEGORIES, 0.0)
        spans = self.action_spans = []
        if self.pending_sends.schedule is not self.schedule:  # the schedule may be swapped between steps
            self.pending_sends = self._pending_sends()
        batches = dict(transfer_runs(program))
        origin = self.action_origin = time.perf_counter()
        until = 0  # the end of the batch being passed over
        for index, action in enumerate(program):
            if index < until:  # posted with its batch
                spans.append((spans[-1][1], spans[-1][1]))
                continue
            if index in batches:
                until = batches[index]
                started = time.perf_counter()
                self._post(program[index:until])
            else:
                if action.is_compute:
                    waited = time.perf_counter()
                    self._take_received(action)
                    self.action_s["transfer"] += time.perf_counter() - waited
                started = time.perf_counter()
                self._run(action, batch)
            ended = time.perf_counter()
            self.action_s[_CATEGORY[action.kind]] += ended - started
            spans.append((started - origin, ended - origin))
        started = time.perf_counter()
        if self.receiving:
            raise RuntimeError(f"pipeline rank {self.rank}: {sorted(map(str, self.receiving))} were received "
                               "but no action of the program used them")
        self.pending_sends.wait_all()
        self.action_s["transfer"] += time.perf_counter() - started
        last = self.schedule.num_stages - 1
        losses = self.state[last].losses if last in self.state else {}
        return [losses[mb].detach() for mb in sorted(losses)]

    def _pending_sends(self) -> PendingSends:
        return PendingSends(schedule=self.schedule, pipeline=self.pipeline, synced_stages=self.synced_stages)

    def _optim(self, action: Action) -> None:
        if self.skip_optim:
            self.stages[action.stage].drop_grads(action.bucket)
            return
        if self.before_optim is not None:
            self.before_optim(action.stage, action.bucket)
        self.stages[action.stage].optim_step(action.bucket)

    def _run(self, action: Action, batch: MicroBatches) -> None:
        kind, stage, mb = action.kind, action.stage, action.micro_batch
        if stage not in self.stages:
            raise ValueError(f"rank {self.rank} was given {action} but holds stages {sorted(self.stages)}")
        if action.is_compute:
            self.stages[stage].require_gathered(f"{action} on pipeline rank {self.rank}")
            started = time.perf_counter()
            if kind is Kind.F:
                self._forward(stage, mb, batch)
            elif kind in (Kind.B, Kind.BW):
                self._backward_input(stage, mb, full=kind is Kind.BW)
            else:
                self._backward_weight(stage, mb)
            if self.slowdown > 1.0:
                # Emulated heterogeneity: this rank computes as if its device were slower.
                pause = (self.slowdown - 1.0) * (time.perf_counter() - started)
                self.emulated_sleep_s += pause
                time.sleep(pause)
        elif kind in P2P_KINDS:
            self._post([action])
        elif kind is Kind.UNSHARD:
            self.stages[stage].unshard(action.bucket)
        elif kind is Kind.RESHARD:
            self.stages[stage].reshard(action.bucket)
        elif kind is Kind.REDUCE_GRAD:
            self.stages[stage].reduce_grad(action.bucket)
        elif kind is Kind.OPTIM:
            self._optim(action)
        elif kind is Kind.CLIP:
            if self.before_clip is not None:
                self.before_clip()
            if self.on_clip is None:
                raise RuntimeError(f"{action} on pipeline rank {self.rank}: the schedule clips gradients "
                                   "but no clipping was configured (TrainConfig.optimizer.clip_norm)")
            self.on_clip()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(self, stage: int, mb: int, batch: MicroBatches) -> None:
        st = self.state[stage]
        if stage == 0:
            inp = batch.inputs[mb]
        else:
            if mb not in st.inputs:
                raise RuntimeError(f"{stage}F{mb} on rank {self.rank}: its input was never received")
            inp = self._whole(st.inputs[mb], stage - 1, stage).detach().requires_grad_(True)
            st.inputs[mb] = inp
        with self._autocast():
            module = self.stages[stage].module
            out = module(inp) if batch.segments is None else module(inp, segments=batch.segments[mb])
            if stage == self.schedule.num_stages - 1:
                st.losses[mb] = self.loss_fn(out, batch.targets[mb]) / batch.loss_tokens
                return
        st.outputs[mb] = out
        if stage + 1 in self.stages:
            self.state[stage + 1].inputs[mb] = out.detach()

    def _backward_input(self, stage: int, mb: int, *, full: bool) -> None:
        st = self.state[stage]
        last = stage == self.schedule.num_stages - 1
        outputs = [self._scaled(st.losses[mb])] if last else [st.outputs.pop(mb)]
        # A gradient received in the wire dtype (:attr:`dtype`) takes the output's dtype back.
        received = None if last else self._whole(st.output_grads.pop(mb), stage + 1, stage)
        grads = None if received is None else [received.to(outputs[0].dtype)]
        inputs = [st.inputs.pop(mb)] if stage > 0 else []
        if full:
            torch.autograd.backward(outputs, grads)
            self._release_graph(stage, mb)
            input_grad = inputs[0].grad if inputs else None
        elif stage == 0:
            # Token ids carry no gradient: the whole backward happens at W (as torch does).
            st.weight_state[mb] = (outputs, grads)
            return
        else:
            dinputs, saved = backward_input(outputs, grads, inputs, self.stages[stage].trained_weights())
            st.weight_state[mb] = saved
            input_grad = dinputs[0]
        if stage > 0:
            st.input_grads[mb] = input_grad
            if stage - 1 in self.stages:
                self.state[stage - 1].output_grads[mb] = input_grad

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scale == 1.0 else loss * self.loss_scale

    def _backward_weight(self, stage: int, mb: int) -> None:
        saved = self.state[stage].weight_state.pop(mb)
        if stage == 0:
            outputs, grads = saved
            torch.autograd.backward(outputs, grads)
        else:
            backward_weight(self.stages[stage].trained_weights(), saved)
        self._release_graph(stage, mb)

    def _release_graph(self, stage: int, mb: int) -> None:
        """A micro-batch's backward is done: the last stage keeps its loss for the report only.
        The loss's graph would keep the received input alive (its leaf's accumulator holds it)
        for every micro-batch until the step ends."""
        losses = self.state[stage].losses
        if mb in losses:
            losses[mb] = losses[mb].detach()

    def _whole(self, tensor: torch.Tensor, peer_stage: int, stage: int) -> torch.Tensor:
        """An activation or gradient from ``peer_stage`` for ``stage``, all-gathered over the TP
        group first when the hop is scattered (it came as this rank's slice)."""
        if not self.hops.scattered(peer_stage, stage):
            return tensor
        if self.tp_group is None:
            raise RuntimeError(f"pipeline rank {self.rank} received a slice of a scattered hop but was "
                               "given no TP group to gather it on (RankExecutor.tp_group)")
        whole = torch.empty(self.activation_shape, dtype=tensor.dtype, device=tensor.device)
        all_gather_single(whole.view(-1), tensor, group=self.tp_group)
        return whole

    def _post(self, actions: Sequence[Action]) -> None:
        """Post a run of consecutive SEND/RECV actions as one batch (NCCL groups them, so a send
        and a receive between the same two ranks never wait for each other), in program order:
        per rank pair the order of the messages is the order both ends list them."""
        ops: list[dist.P2POp] = []
        sends: list[tuple[int, int, Action]] = []  # (op index, destination, SEND)
        receives: list[tuple[int, Action, torch.Tensor, int]] = []  # (op index, RECV, buffer, source)
        for action in actions:
            if action.kind in SEND_KINDS:
                tensor = self._outgoing(action)
                for peer in self.hops.destinations(p2p_peer_stage(action)):
                    sends.append((len(ops), peer, action))
                    ops.append(dist.P2POp(dist.isend, tensor, peer))
            else:
                buffer, source = self._incoming(action)
                receives.append((len(ops), action, buffer, source))
                ops.append(dist.P2POp(dist.irecv, buffer, source))
        if not ops:  # a send to a TP group none of whose members takes from this rank
            return
        works = dist.batch_isend_irecv(ops)
        # One work per operation (gloo), or one for the whole batch (NCCL's coalesced group).
        per_op = works if len(works) == len(ops) else [works[-1]] * len(ops)
        for index, peer, action in sends:
            self.pending_sends.add(per_op[index], dst=peer, key=message_key(action))
        for index, action, buffer, source in receives:
            self.receiving[action] = (per_op[index], buffer, source)

    def _outgoing(self, action: Action) -> torch.Tensor:
        """The tensor a SEND carries: the stage's output (SEND_F) or its input gradient (SEND_B),
        in the wire dtype; of a scattered hop this TP rank's slice only."""
        st, mb, peer_stage = self.state[action.stage], action.micro_batch, p2p_peer_stage(action)
        tensor = st.outputs[mb].detach() if action.kind is Kind.SEND_F else st.input_grads.pop(mb)
        tensor = tensor.to(self.dtype).contiguous()
        if self.hops.scattered(peer_stage, action.stage):
            # This rank's slice only (the tensor is whole on every TP rank), copied so that the
            # pending send does not keep the whole tensor alive until it is known delivered.
            n = self.hops.slice_numel()
            tensor = tensor.view(-1).narrow(0, self.tp_rank * n, n).clone()
        return tensor

    def _incoming(self, action: Action) -> tuple[torch.Tensor, int]:
        """The buffer a RECV fills and the global rank it comes from."""
        peer_stage = p2p_peer_stage(action)
        shape = self.hops.received_shape(peer_stage, action.stage)
        return torch.empty(shape, dtype=self.dtype, device=self.device), self.hops.source(peer_stage)

    def _take_received(self, action: Action) -> None:
        """Before a compute action: wait for the message it consumes, if it came from another rank
        (on NCCL the wait orders the compute stream after the receive; the host goes on)."""
        if action.kind is Kind.W or action.micro_batch is None:
            return
        recv = Action(action.stage, Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B, action.micro_batch)
        posted = self.receiving.pop(recv, None)
        if posted is None:
            return
        work, buffer, source = posted
        work.wait()
        self.pending_sends.received(src=source, key=message_key(recv))
        st = self.state[action.stage]
        if recv.kind is Kind.RECV_F:
            st.inputs[action.micro_batch] = buffer
        else:
            st.output_grads[action.micro_batch] = buffer
