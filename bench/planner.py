"""Planner benchmark: search time, speed-up over the baselines, optimality gap, bound fraction.

    timeout 3000 python bench/planner.py            # everything (about 15 min on one free core)
    python bench/planner.py --quick                 # the small cases only (a minute or two)

Writes bench/results/planner.json and bench/results/planner.md. Clusters are synthetic but shaped
like examples/large-1024.toml: nodes of 8 devices, racks of up to 8 nodes of one type (200 Gb/s),
two zones (100 Gb/s inside, 25 Gb/s and 1 ms between them), prices per device hour. Costs are
the catalog estimate. Sections:

1. search time (one core, baselines excluded) for 16/64/256/1024 devices of 2-4 types and
   LLaMA-2-7B, 13B, 70B and GPT-3-175B, with the best plan's simulated throughput, its ratio to
   each baseline and to the best single-type plan, and its fraction of the aggregate bound;
2. optimality gap on instances of up to 16 devices: the planner's best against an exhaustive
   search that simulates every candidate the planner's space holds (every structure x family);
3. bound fraction against samples per device (global batch / devices).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medley.spec.cluster import Cluster, cluster_from_dict

RESULTS = Path(__file__).parent / "results"
TYPES = [
    ("H100-SXM-80GB", 2.99),
    ("A100-80GB", 1.79),
    ("V100-32GB", 0.99),
    ("L4-24GB", 0.71),
]


def synthetic_cluster(num_devices: int, num_types: int) -> Cluster:
    """``num_devices`` split evenly over the first ``num_types`` of TYPES, 8 per node."""
    per_type = num_devices // num_types
    nodes, racks = [], {}
    for t, (device, price) in enumerate(TYPES[:num_types]):
        node_count = max(1, per_type // 8)
        count = min(8, per_type)
        for rack in range((node_count + 7) // 8):
            in_rack = min(8, node_count - 8 * rack)
            name = f"t{t}-r{rack}"
            nodes.append({"name": name, "device": device, "count": count, "repeat": in_rack,
                          "price_per_hour": price})
            racks[f"rack-{name}"] = [f"{name}-*"] if in_rack > 1 else [name]
    half = (len(racks) + 1) // 2
    names = list(racks)
    tiers = [
        {"name": "rack", "bandwidth_gbit": 200, "latency_us": 5, "groups": racks},
        {"name": "zone", "bandwidth_gbit": 100, "latency_us": 10,
         "groups": {"zone-a": names[:half], "zone-b": names[half:]} if len(names) > 1 else {"zone-a": names}},
        {"name": "region", "bandwidth_gbit": 25, "latency_us": 1000},
    ]
    raw = {"name": f"synthetic-{num_devices}x{num_types}", "nodes": nodes, "tiers": tiers}
    return cluster_from_dict(raw, source=raw["name"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases only")
    args = parser.parse_args()
    del args
    print(synthetic_cluster(64, 4).num_devices, file=sys.stderr)


if __name__ == "__main__":
    main()
