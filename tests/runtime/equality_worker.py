"""Rank body of the runtime equality tests: run many plans in one process-group launch and compare
each against the single-process reference (same seed, whole global batch)."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from medley.cost.recompute import parse_recompute
from medley.data.source import MicroBatches
from medley.plan.layout import sharded_edges
from medley.runtime.executor import RankExecutor
from medley.runtime.groups import RankTable, make_groups, row_major_table
from medley.runtime.stages import build_local_stages, layer_ranges
from medley.runtime.tensor_parallel import is_tp_sharded
from medley.runtime.transformer import Block, Decoder, token_loss_sum
from medley.schedule.ir import Kind, PipelineSchedule, with_default_collectives
from medley.spec.model_arg import get_model

SEQ, MBS, SEED, LR = 16, 2, 7, 0.1


@dataclass(kw_only=True)
class Case:
    """One plan: ``schedules[r]`` is replica r's program (micro-batch counts may differ);
    ``table[r][p]`` the global ranks (TP rank order) on pipeline rank p of replica r (None:
    row-major); ``tp`` the TP degree of each pipeline rank (empty: 1). On one machine playing every
    node rank i is device i, so the table is the plan's device groups."""

    name: str
    pp: int
    dp: int
    split: tuple[int, ...]
    zero: tuple[int, ...]
    schedules: list[PipelineSchedule] = field(default_factory=list)
    table: RankTable | None = None
    dtype: str = "fp32"  # the run's precision (the equality cases are fp32)
    tp: tuple[int, ...] = ()
    groups: tuple = ()  # replica groups of their own shape (PlanLayouts, medley.plan.segments): then
    # ``schedules`` are every replica's (groups in order), and split/zero/pp/dp are unused
    recompute: tuple = ()  # per stage, a medley.cost.recompute.Recompute or its text (empty: none)

    sequence_parallel: bool = False  # TP stages run sequence parallelism

    @property
    def world(self) -> int:
        if self.groups:
            return sum(len(ranks) for row in self.table or () for ranks in row)
        return self.dp * (sum(self.tp) if self.tp else self.pp)


def global_batch(micro_batches: list[int], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (sum(micro_batches) * MBS, SEQ + 1), generator=gen)


def replica_batch(tokens: torch.Tensor, micro_batches: list[int], replica: int) -> MicroBatches:
    start = sum(micro_batches[:replica]) * MBS
    rows = tokens[start:start + micro_batches[replica] * MBS]
    chunks = rows.split(MBS)
    return MicroBatches(inputs=[c[:, :-1] for c in chunks], targets=[c[:, 1:] for c in chunks],
                        loss_tokens=tokens[:, 1:].numel())


def reference_step(model: Decoder, tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Gradients of the global-batch mean token loss, and per-micro-batch scaled losses."""
    n_tokens = tokens[:, 1:].numel()
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / n_tokens
    loss.backward()
    with torch.no_grad():
        per_mb = [token_loss_sum(model(c[:, :-1]), c[:, 1:]).item() / n_tokens for c in tokens.split(MBS)]
    return {n: p.grad.clone() for n, p in model.named_parameters()}, per_mb


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if not got or any(n not in want for n in got):
        raise AssertionError(f"names do not match the reference: {sorted(set(got) ^ set(want))[:4]}")
    return max((got[n] - want[n]).abs().max().item() for n in got)


def tp_figures(stages: dict, tp: int, sequence_parallel: bool = False) -> dict[str, float]:
    """Whether TP really cut this rank's blocks: ``tp_sharded`` counts its TP-sharded parameters,
    ``tp_missing`` is 1 when its degree is above 1 and a block's linear weight is whole, or, under
    sequence parallelism, a block's norm weight is not a DTensor replicated over TP."""
    named = [(name, p) for stage in stages.values() for name, p in stage.named_parameters_local()
             if name.startswith("blocks.")]
    linear = [p for name, p in named if "norm" not in name]
    sharded = sum(is_tp_sharded(p) for p in linear)
    norms = [p for name, p in named if "norm" in name]
    sequence = sum(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in norms)
    missing = sharded < len(linear) or (sequence_parallel and sequence < len(norms))
    return {"tp_sharded": float(sharded), "tp_missing": float(tp > 1 and missing)}


def sequence_edges(case: Case, schedule: PipelineSchedule, spec) -> frozenset[int]:
    """The edges a sequence-parallel case's shards cross (:func:`medley.plan.layout.sharded_edges`)."""
    if not case.sequence_parallel:
        return frozenset()
    ranges = [range(a, b) for a, b in layer_ranges(case.split, spec.num_layers)]
    degrees = [(case.tp or (1,) * case.pp)[rank] for rank in schedule.stage_to_rank]
    return sharded_edges(spec, ranges, degrees)


def run_case(case: Case) -> dict:
    spec = get_model("tiny")
    groups = make_groups(case.table or row_major_table(case.pp, case.dp, case.tp))
    place = groups.place
    micro_batches = [s.num_micro_batches for s in case.schedules]
    schedule = with_default_collectives(case.schedules[place.replica])
    sgd = dict(lr=LR)
    edges = sequence_edges(case, schedule, spec)
    stages = build_local_stages(spec, schedule=schedule, split=case.split, zero=case.zero, groups=groups,
                                seed=SEED, optimizer_class=torch.optim.SGD, optimizer_kwargs=sgd,
                                recompute=[parse_recompute(r) for r in case.recompute],
                                sequence_parallel=case.sequence_parallel, sequence_edges=edges)
    block_calls = [0]  # blocks' forward calls: beyond one per micro-batch when they recompute
    for stage in stages.values():
        for block in (m for m in stage.module.modules() if isinstance(m, Block)):
            block.register_forward_pre_hook(lambda *_: block_calls.__setitem__(0, block_calls[0] + 1))
    # The first step stops before OPTIM so that gradients can be compared.
    no_optim = [[a for a in row if a.kind is not Kind.OPTIM] for row in schedule.actions]
    executor = RankExecutor(
        schedule=schedule.with_actions(no_optim), pipeline_rank=place.pipeline_rank, stages=stages,
        pipeline=groups.pipeline,
        tp_rank=place.tp_rank, tp_group=groups.tp_group, activation_shape=(MBS, SEQ, spec.hidden_size),
        sequence_edges=edges,
        loss_fn=token_loss_sum)
    reference = Decoder(spec, seed=SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), **sgd)
    result = {"grad": 0.0, "loss": 0.0, "param1": 0.0, "param2": 0.0,
              **tp_figures(stages, groups.tp, case.sequence_parallel)}
    for step in range(2):
        tokens = global_batch(micro_batches, step)
        losses = executor.run_step(replica_batch(tokens, micro_batches, place.replica))
        ref_grads, ref_losses = reference_step(reference, tokens)
        if losses:
            first = sum(micro_batches[:place.replica])
            want = ref_losses[first:first + len(losses)]
            diffs = [abs(a.item() - b) for a, b in zip(losses, want, strict=True)]
            result["loss"] = max(result["loss"], *diffs)
        if step == 0:
            blocks = sum(isinstance(m, Block) for stage in stages.values() for m in stage.module.modules())
            result["reruns"] = float(block_calls[0] - blocks * micro_batches[place.replica])
            for index in sorted(stages):
                result["grad"] = max(result["grad"], max_diff(stages[index].named_grads(), ref_grads))
            for index in sorted(stages):
                stages[index].optim_step(None)
                stages[index].unshard(None)  # levels 1-2 gather the updated weights after the step
        ref_opt.step()
        ref_params = dict(reference.named_parameters())
        for index in sorted(stages):
            diff = max_diff(stages[index].named_params(), ref_params)
            result[f"param{step + 1}"] = max(result[f"param{step + 1}"], diff)
        # The second step runs the full program, OPTIM actions included.
        executor.schedule = schedule
    return result


def worker(rank: int, world: int, port: int, cases: list[Case], out_path: str,
           body: Callable[[Case], dict] = run_case) -> None:
    """Run ``body`` (by default the equality check) on every case of this world size."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(150, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    for case in cases:
        if case.world != world:
            continue
        try:
            results[case.name] = body(case)
        except Exception:  # noqa: BLE001 - reported per case; other ranks may then time out
            results[case.name] = {"error": traceback.format_exc(limit=6)}
            print(f"rank {rank} case {case.name}:\n{results[case.name]['error']}", file=sys.stderr)
            break
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
