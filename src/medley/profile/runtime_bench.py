"""medley's executor against torch's own schedule classes on the same model, data and micro-batches.

Both sides run in the same process-group launch, alternating rounds so that drift in the machine's
load hits both alike. medley: :func:`medley.runtime.setup.build_rank` and its executor's program
(F/BW, send/recv, the plan's REDUCE_GRAD and OPTIM actions). torch: the same stage modules
(:class:`medley.runtime.transformer.Decoder` slices, same seed) in ``PipelineStage`` driven by
``Schedule1F1B`` / ``ScheduleGPipe``, then (dp > 1) one flat SUM all-reduce of the gradients per
stage over the replica group, as medley's ZeRO-0 does (torch's DDP-wrapped stages are avoided:
see research/torch_runtime.md), then AdamW. Loss: token-sum cross entropy over the global token
count, ``scale_grads=False``, on both sides. A step's time is the slowest rank's, after a barrier.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from medley.plan.plan import Plan

TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


@dataclass(frozen=True, kw_only=True)
class RuntimeCase:
    name: str
    plan: Plan


def _timed_step(fn) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


class _TorchSide:
    """The plan's stage on this rank, run by torch's schedule class."""

    def __init__(self, plan: Plan, groups, replica: int, pipeline_rank: int, seed: int) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        from medley.runtime.transformer import Decoder, token_loss_sum

        layout = plan.layout
        start = sum(layout.stage_layers[:pipeline_rank])
        stop = start + layout.stage_layers[pipeline_rank]
        self.module = Decoder(layout.model, first_layer=start, last_layer=stop, seed=seed)
        self.first, self.last = pipeline_rank == 0, pipeline_rank == layout.pp - 1
        stage = PipelineStage(self.module, pipeline_rank, layout.pp, torch.device("cpu"),
                              group=groups.replica_group)
        n_tokens = layout.tokens_per_step
        schedule_class = getattr(schedules, TORCH_SCHEDULES[layout.schedule])
        self.schedule = schedule_class(stage, n_microbatches=layout.micro_batches[replica],
                                       loss_fn=lambda out, tgt: token_loss_sum(out, tgt) / n_tokens,
                                       scale_grads=False)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.dp_group = groups.dp_mesh.get_group() if layout.dp > 1 else None

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if self.first:
            self.schedule.step(inputs)
        elif self.last:
            self.schedule.step(target=targets)
        else:
            self.schedule.step()
        if self.dp_group is not None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.module.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
            offset = 0
            for param, grad in zip(self.module.parameters(), grads, strict=True):
                param.grad = flat[offset:offset + grad.numel()].view_as(grad)
                offset += grad.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _run_case(case: RuntimeCase, rounds: int, steps: int, seed: int) -> dict:
    from medley.data.load import load_source
    from medley.data.source import replica_slice
    from medley.runtime.setup import build_rank

    plan, layout = case.plan, case.plan.layout
    setup = build_rank(plan, seed=seed, optimizer_class=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-4})
    theirs = _TorchSide(plan, setup.groups, setup.replica, setup.pipeline_rank, seed)
    source = load_source("synthetic", seq_len=layout.seq_len)
    sequences = sum(layout.micro_batches) * layout.micro_batch_size
    batches = []
    for step in range(steps):
        rows = source.global_rows(step=step, seed=seed, sequences=sequences, seq_len=layout.seq_len)
        batches.append(replica_slice(rows, micro_batches=layout.micro_batches,
                                     micro_batch_size=layout.micro_batch_size, replica=setup.replica))
    ours_s: list[float] = []
    torch_s: list[float] = []
    for round_index in range(rounds + 1):  # round 0 warms both up (torch infers shapes then)
        ours = [_timed_step(lambda b=b: setup.executor.run_step(b)) for b in batches]
        their = [_timed_step(lambda b=b: theirs.step(torch.cat(b.inputs), torch.cat(b.targets)))
                 for b in batches]
        if round_index > 0:
            ours_s += ours
            torch_s += their
    return {"medley_s": ours_s, "torch_s": torch_s}


def worker(rank: int, world: int, port: int, cases: list[RuntimeCase], rounds: int, steps: int,
           out_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for case in cases:
            if case.plan.world_size == world:
                results[case.name] = _run_case(case, rounds, steps, seed=0)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def overhead(figures: dict) -> dict:
    ours, theirs = statistics.median(figures["medley_s"]), statistics.median(figures["torch_s"])
    return {"medley_step_s": ours, "torch_step_s": theirs, "ratio": ours / theirs,
            "medley_min_s": min(figures["medley_s"]), "torch_min_s": min(figures["torch_s"]),
            "ratio_of_minima": min(figures["medley_s"]) / min(figures["torch_s"]),
            "samples": len(figures["medley_s"])}
