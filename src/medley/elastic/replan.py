"""Re-plan a running job for the devices it has now: the same model, global batch, sequence length
and precision, the planner's usual search (memory checked as for ``medley plan``) over the
devices present, each slowed device planned at the speed it was measured at.

The cluster stays the plan's (device ids keep their meaning across plans); devices that are not
present are excluded from the search. A device measured slower than its type is planned with its
FLOP/s divided by the measured factor (a per-device ``tflops`` override of the cluster, kept in
the new plan's cluster), so that every later re-plan sees the same speed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.plan.plan import Plan
from medley.runtime.placement import world_size_terms
from medley.search.planner import search
from medley.search.space import Constraints
from medley.spec.cluster import Cluster
from medley.spec.cluster_load import cluster_from_dict


def global_batch(plan: Plan) -> int:
    """Sequences per optimizer step (what every re-plan keeps)."""
    return plan.sequences_per_step


def describe(plan: Plan) -> str:
    """``pp 2 x dp 1 on devices 0,1`` (TP and replica groups as the plan has them)."""
    return f"{world_size_terms(plan)} on devices {','.join(map(str, sorted(plan.devices)))}"


def with_slowed(cluster: Cluster, slower: Mapping[int, float]) -> Cluster:
    """``cluster`` with each device of ``slower`` (id: factor > 1) at its measured speed: a
    per-device ``tflops`` override in the cluster spec (a repeated node entry is written out
    copy by copy first), so that the plan file keeps it."""
    slower = {d: f for d, f in slower.items() if f > 1.0}
    if not slower or cluster.source_spec is None:
        return cluster
    spec = copy.deepcopy(cluster.source_spec)
    for device_id, factor in sorted(slower.items()):
        device = cluster.devices[device_id]
        entry = _own_entry(spec["nodes"], device.node)
        kept = [o for o in entry.get("devices", []) if o["local_rank"] != device.local_rank]
        old = next((o for o in entry.get("devices", []) if o["local_rank"] == device.local_rank), {})
        kept.append({**old, "local_rank": device.local_rank, "tflops": device.type.peak_tflops_half / factor})
        entry["devices"] = sorted(kept, key=lambda o: o["local_rank"])
    return cluster_from_dict(spec, source=f"cluster '{cluster.name}' with measured speeds")


def _own_entry(nodes: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The node entry of node ``name`` alone (a ``repeat`` entry holding it is split into copies)."""
    for index, entry in enumerate(nodes):
        repeat = int(entry.get("repeat", 1))
        if repeat == 1 and entry["name"] == name:
            return entry
        names = [f"{entry['name']}-{r}" for r in range(repeat)] if repeat > 1 else []
        if name in names:
            hosts = entry.get("hosts")
            copies = []
            for r, copy_name in enumerate(names):
                one = {k: v for k, v in entry.items() if k not in ("repeat", "hosts")}
                one["name"] = copy_name
                if hosts:
                    one["host"] = hosts[r]
                copies.append(one)
            nodes[index:index + 1] = copies
            return copies[names.index(name)]
    raise KeyError(name)


def replan(plan: Plan, present: Sequence[int], *, slower: Mapping[int, float] | None = None) -> Plan:
    """The fastest plan for ``plan``'s model, global batch, sequence length and precision on the
    devices ``present`` (ids of ``plan.cluster``). A :class:`MedleyInputError` when none fits: it
    names the devices and what the planner found lacking."""
    cluster = with_slowed(plan.cluster, slower or {})
    layout = plan.shared
    missing = [d for d in range(cluster.num_devices) if d not in set(present)]
    constraints = Constraints(exclude_devices=tuple(missing), dtype=layout.dtype)
    cost = CatalogCostSource.for_cluster(layout.model, cluster, dtype=layout.dtype)
    try:
        result = search(cluster, layout.model, global_batch=global_batch(plan), seq_len=layout.seq_len,
                        cost=cost, top=1, constraints=constraints, baselines=False)
    except MedleyInputError as err:
        raise MedleyInputError(
            f"re-plan for the {len(present)} device(s) left ({','.join(map(str, present)) or 'none'}): no "
            f"plan fits ({err}); the run stops, its checkpoints are kept: bring nodes back and launch "
            "again") from None
    return result.best.plan
