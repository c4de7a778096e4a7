"""Carry a plan over to torch / torchtitan (``medley plan --export torch DIR``).

Writes into DIR:

* ``replica{r}.csv``: replica r's schedule as torch pipelining's compute-only action CSV (load it
  with ``_PipelineScheduleRuntime._load_csv(path, format="compute_only")``; torch inserts the
  SEND/RECV and its own FSDP UNSHARD/RESHARD/REDUCE_GRAD). Replicas with equal micro-batch
  counts get identical files.
* ``module_fqns_per_model_part.json``: for each pipeline stage (model part, in stage order), the
  module names in torchtitan's LLaMA naming (``tok_embeddings``, ``layers.N``, ``norm``,
  ``output``), the form torchtitan's ``module_fqns_per_model_part`` setting takes.
* ``plan.json``: the rest a torchtitan user needs to reproduce the plan: pp, dp, the device of
  each (replica, rank), the stage-to-rank map, micro-batch size and counts, ZeRO level and
  recomputation per stage, the schedule family and knobs, and the predicted step time.

What torch cannot express is said in ``plan.json``'s ``notes``: medley's bucketed, bubble-placed
ZeRO collectives become FSDP2's per-stage ones, and uneven micro-batch counts need one schedule
per replica (torchtitan runs one schedule for all replicas, so use the largest count or run the
replicas' CSVs separately).
"""

from __future__ import annotations

import json
from pathlib import Path

from medley.errors import MedleyInputError
from medley.fileio import write_atomically
from medley.plan.plan import Plan
from medley.schedule.generators import generate
from medley.schedule.torch_csv import write_torch_csv
from medley.spec.model import ModelSpec


def torchtitan_fqns(model: ModelSpec, layers: range) -> list[str]:
    """torchtitan module names of medley layers ``layers`` (0 embedding, 1..n blocks, last head)."""
    names: list[str] = []
    for index in layers:
        kind = model.layer_kind(index)
        if kind == "embedding":
            names.append("tok_embeddings")
        elif kind == "block":
            names.append(f"layers.{index - 1}")
        else:
            names += ["norm", "output"]
    return names


def export_torch(plan: Plan, directory: Path) -> list[Path]:
    """Write the files described in the module docstring; returns their paths."""
    if plan.asymmetric:
        raise MedleyInputError(
            f"--export torch: this plan has {len(plan.groups)} replica groups of their own shape, and "
            "torch's pipelining and torchtitan run one pipeline shape for every replica; export a plan "
            "of alike replicas (medley plan --no-asymmetric) or train this one with medley train")
    layout = plan.layout
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    schedules = {}
    for replica, count in enumerate(layout.micro_batches):
        if count not in schedules:
            schedules[count] = generate(layout.schedule, pp=layout.pp, micro_batches=count, **layout.knobs)
        path = directory / f"replica{replica}.csv"
        write_torch_csv(schedules[count], path)
        written.append(path)
    schedule = schedules[layout.micro_batches[0]]
    parts = [torchtitan_fqns(layout.model, layout.layer_range(s)) for s in range(layout.num_stages)]
    fqn_path = directory / "module_fqns_per_model_part.json"
    write_atomically(fqn_path, json.dumps(parts, indent=1) + "\n")
    written.append(fqn_path)
    notes = [
        "ZeRO collectives: medley places them per layer bucket into pipeline bubbles; in torch use FSDP2 "
        "per stage (reshard_after_forward for ZeRO-3, its default reduce-scatter for levels 1-2).",
    ]
    if len(set(layout.micro_batches)) > 1:
        notes.append(
            "Replicas run different micro-batch counts (uneven data split by speed): each replica's CSV "
            "is its own; scale each replica's loss by its share of the global batch."
        )
    meta = {
        "model": layout.model.name,
        "pp": layout.pp,
        "dp": layout.dp,
        "assignment": [list(row) for row in layout.assignment],
        "device_types": [[plan.cluster.devices[d].type.name for d in row] for row in layout.assignment],
        "stage_to_rank": list(schedule.stage_to_rank),
        "schedule": layout.schedule,
        "knobs": dict(layout.knobs),
        "micro_batch_size": layout.micro_batch_size,
        "micro_batches": list(layout.micro_batches),
        "seq_len": layout.seq_len,
        "stage_layers": list(layout.stage_layers),
        "zero_levels": [z.level for z in layout.zero],
        "recompute": [bool(r) for r in layout.recompute],
        "recompute_mode": [str(r) for r in layout.recompute],
        "dtype": layout.dtype,
        "predicted_step_time_s": plan.prediction.step_time_s if plan.prediction else None,
        "notes": notes,
    }
    meta_path = directory / "plan.json"
    write_atomically(meta_path, json.dumps(meta, indent=1) + "\n")
    written.append(meta_path)
    return written
