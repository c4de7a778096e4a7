"""Plans on small multi-node clusters for the launcher's tests (no torch needed to build them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan, save_plan
from medley.spec.cluster_load import load_cluster
from medley.spec.model_arg import get_model
from medley.testing.elastic_scenario import TIERS

SEQ_LEN, MICRO_BATCH_SIZE = 32, 2


def node_toml(name: str, count: int, *, device: str = "CPU-8GB", host: str | None = None,
              hosts: list[str] | None = None) -> str:
    text = f'[[nodes]]\nname = "{name}"\ndevice = "{device}"\ncount = {count}\n'
    if host is not None:
        text += f'host = "{host}"\n'
    if hosts is not None:
        text += f"repeat = {len(hosts)}\nhosts = {hosts!r}\n".replace("'", '"')
    return text


def cluster_file(directory: Path, *nodes: str, name: str = "cluster.toml") -> Path:
    path = directory / name
    path.write_text('name = "launch-test"\n' + "".join(nodes) + TIERS)
    return path


def tiny_plan(cluster: Path, *, pp: int, dp: int, assignment: tuple[tuple[int, ...], ...],
              split: str, micro_batches: str = "2", zero: str | None = None,
              tp: tuple[int, ...] = ()) -> Plan:
    """A tiny-model plan on ``cluster`` whose replica r runs pipeline rank k on ``assignment[r][k]``
    (with ``tp``: on the ``tp[k]`` devices from there)."""
    spec = load_cluster(cluster)
    model = get_model("tiny")
    layout = inline_layout(cluster=spec, model=model, cost=CatalogCostSource.for_cluster(model, spec), pp=pp,
                           dp=dp, schedule="1f1b", micro_batches=micro_batches,
                           micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, split=split,
                           zero=zero or ",".join(["1"] * pp))
    return Plan(layout=dataclasses.replace(layout, assignment=assignment, tp=tp), cluster=spec)


def plan_file(directory: Path, plan: Plan, name: str = "plan.toml") -> Path:
    path = directory / name
    save_plan(plan, path)
    return path
