"""The planner benchmark's Markdown (bench/planner.py): every figure, in the tables and in the
summary's sentences, is read from the JSON data."""

from __future__ import annotations

from statistics import median

from medley.search.rank.baselines import NAMES
from medley.search.report.ablation import STEPS

STEP_TITLES = {
    "schedule": "1F1B only",
    "heterogeneity": "homogeneous treatment",
    "zero-and-placement": "one ZeRO option, naive placement",
    "tp": "tp 1",
    "replica-shapes": "alike replicas only",
}
BASELINE_POOLS = ("megatron-lm-style", "metis-style", "fastest-type-only")
"""Pool names of the baselines' plans (a search result's best plan with one came from a baseline)."""


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _provenance(data: dict) -> list[str]:
    lines = []
    for section in ("pruning", "bound"):
        made = data.get("provenance", {}).get(section)
        if data.get(section):
            how = (f"commit `{made['commit']}`, command `{made['command']}`" if made
                   else "commit not recorded (measured before results recorded it)")
            lines.append(f"- {section}: {how}")
    return lines


def _fitting(data: dict) -> list[dict]:
    """Search rows that fit and were measured with the current baselines."""
    return [r for r in data.get("search", []) if r.get("fits") and "baselines" in r]


def summary(data: dict) -> list[str]:
    """Sentences whose every figure comes from ``data``."""
    rows = _fitting(data)
    out = [f"Search rows measured with the current baselines: {len(rows)} that fit.", ""] if rows else []
    for name in NAMES:
        ratios = [r["versus"][name] for r in rows if r["versus"].get(name) is not None]
        if ratios:
            out.append(
                f"- vs {name}: median {median(ratios):.2f}x, least {min(ratios):.2f}x, most "
                f"{max(ratios):.2f}x over {len(ratios)} cases "
                f"({len(rows) - len(ratios)} where it fits nowhere)."
            )
    mixed = [r for r in rows if r["devices"] >= 64 and r["types"] > 1]
    goal = [r for r in mixed if (r["versus"].get(NAMES[0]) or float("inf")) >= 1.3]
    if mixed:
        out.append(
            f"- Goal >= 1.3x {NAMES[0]} on every mixed case of >= 64 devices: met on {len(goal)} of "
            f"{len(mixed)} (a baseline that fits nowhere counts as met)."
        )
    for r in mixed:
        if r not in goal:
            ratio = r["versus"][NAMES[0]]
            out.append(
                f"  - missed at {r['devices']} devices, {r['model']}: {ratio:.3f}x; 1.3x needs "
                f"{1.3 * r['aggregate_fraction'] / ratio:.1%} of the aggregate bound, the plan reaches "
                f"{r['aggregate_fraction']:.1%}."
            )
            used, theirs = r.get("used_fraction"), (r.get("baselines_used_fraction") or {}).get(NAMES[0])
            if used is not None and theirs is not None:
                out.append(
                    f"  - the plan runs on {r['devices_used']} of the {r['devices']} devices and reaches "
                    f"{used:.1%} of their bound; {NAMES[0]} reaches {theirs:.1%} of its own devices'; 1.3x "
                    f"needs {1.3 * used / ratio:.1%} of the plan's devices' bound."
                )
    out += _time_goals(data)
    ablated = [r["ablation"] for r in rows if r.get("ablation")]
    for step in STEPS:
        shares = [a["steps"][step]["share_of_gain"] for a in ablated
                  if a["steps"][step]["share_of_gain"] is not None]
        if shares:
            out.append(
                f"- Taking away {step} alone ({STEP_TITLES[step]}): median {median(shares):.0%} of the "
                f"gain over the best baseline (range {min(shares):.0%} to {max(shares):.0%}, "
                f"{len(shares)} cases)."
            )
    losses = [r["loss_from_pruning"] for r in data.get("pruning", []) if r["loss_from_pruning"] is not None]
    if losses:
        out.append(
            f"- Loss from pruning against the reference search: median {median(losses):.1%}, worst "
            f"{max(losses):.1%} over {len(losses)} cases."
        )
    fractions = [r["aggregate_fraction"] for r in rows]
    if fractions:
        out.append(
            f"- Fraction of the aggregate bound: {min(fractions):.0%} to {max(fractions):.0%} over the same "
            f"{len(fractions)} search rows."
        )
    behind = [r for r in data.get("bound", []) if (r.get("versus_best_baseline") or 2.0) < 1.0]
    for r in behind:
        out.append(
            f"- Behind a baseline: {r['case']}, {r['samples_per_device']} samples per device: the best "
            f"plan is {r['versus_best_baseline']:.3f}x of {r.get('best_baseline') or 'the best baseline'} "
            "(the planner's search misses that baseline's plan)."
        )
    adopted = [r for r in data.get("bound", []) if r.get("best_plan", "").split(" ")[0] in BASELINE_POOLS]
    for r in adopted:
        out.append(
            f"- Taken from a baseline: {r['case']}, {r['samples_per_device']} samples per device: the "
            f"best plan is {r.get('best_baseline')}'s ({r['best_plan']}); the planner's own candidates "
            "missed it and the search ranks the baselines' plans with its own."
        )
    return out


def _time_goals(data: dict) -> list[str]:
    """The search-time goals: <= 2 s up to 64 devices, <= 10 s at 1,024 (search rows, and the
    large section's search)."""
    out = []
    rows = data.get("search", [])
    for label, limit, chosen in (("up to 64 devices", 2.0, [r for r in rows if r["devices"] <= 64]),
                                 ("at 1,024 devices", 10.0, [r for r in rows if r["devices"] == 1024])):
        if not chosen:
            continue
        over = [r for r in chosen if r["search_cpu_s"] > limit]
        said = ", ".join(f"{r['devices']} devices {r['model']} {r['search_cpu_s']:.2f} s" for r in over)
        out.append(f"- Goal search <= {limit:.0f} s {label}: met on {len(chosen) - len(over)} of "
                   f"{len(chosen)} rows" + (f"; over: {said}." if over else "."))
    profiles = data.get("profiles", [])
    if profiles:
        over = [r for r in profiles if r["search_cpu_s"] > (2.0 if r["devices"] <= 64 else 10.0)]
        said = ", ".join(f"{r['cluster']} {r['model']} {r['search_cpu_s']:.2f} s" for r in over)
        tail = f"; over: {said}." if over else "."
        out.append(f"- Goal search <= 2 s up to 64 devices on measured profiles: met on "
                   f"{len(profiles) - len(over)} of {len(profiles)} rows" + tail)
    large = data.get("large")
    if large:
        efficiency = (large.get("heterogeneity") or {}).get("efficiency")
        out.append(
            f"- Goal {large['model']} on {large['cluster']} ({large['global_batch']:,} x "
            f"{large['seq_len']:,}) >= 66% of the aggregate bound (issue 27; 75% issue 14), searched in "
            f"<= 10 s: {large['aggregate_fraction']:.1%} ({large['tokens_per_s']:,.0f} tokens/s), search "
            f"{large['search_cpu_s']:.2f} s CPU" + ("" if efficiency is None else
                                                    f"; heterogeneity efficiency {efficiency:.2f}") + "."
        )
    mixed = [r for r in data.get("search", []) if r.get("heterogeneity") and r["devices"] >= 64]
    if mixed:
        met = [r for r in mixed if (r["heterogeneity"]["efficiency"] or 0.0) >= 0.95]
        worst = min(mixed, key=lambda r: r["heterogeneity"]["efficiency"] or 0.0)
        out.append(f"- Goal heterogeneity efficiency >= 0.95 on every mixed row of >= 64 devices: met on "
                   f"{len(met)} of {len(mixed)}; least {worst['heterogeneity']['efficiency']:.2f} "
                   f"({worst['devices']} devices, {worst['model']}).")
        asymmetric = [r for r in data.get("search", []) if r.get("asymmetric")]
        out.append(f"- Rows whose best plan runs replica groups of their own shape: {len(asymmetric)}.")
    return out


def _large_section(data: dict) -> list[str]:
    r = data["large"]
    made = data.get("provenance", {}).get("large")
    how = f"Commit `{made['commit']}`, command `{made['command']}`." if made else ""
    runs = ", ".join(f"{s:.2f}" for s in r["search_cpu_runs"]) or "none"
    return [
        f"## {r['model']} on {r['cluster']} ({r['devices']:,} devices, {r['global_batch']:,} x "
        f"{r['seq_len']:,} tokens)",
        "",
        how,
        "",
        "| tokens/s | of bound | heterogeneity efficiency | plan | devices used | idle | stage types in "
        "order | recomputing stages | bubble | exposed comm s | step s | search s (cpu; fresh runs) |",
        "|---:|---:|---:|---|---:|---|---|---:|---:|---:|---:|---|",
        f"| {r['tokens_per_s']:,.0f} | {r['aggregate_fraction']:.1%} | {_efficiency(r)} | {r['plan']} | "
        f"{r['devices_used']:,} | {_idle(r)} | {_stage_types(r['stage_types'])} | {r['recomputing_stages']} "
        f"| {r['bubble_fraction']:.1%} | {r['exposed_comm_s']:.2f} | {r['step_time_s']:.2f} | "
        f"{r['search_cpu_s']:.2f} ({runs}) |",
        "",
        *_reference_lines(r),
    ]


def _stage_types(types: list) -> str:
    """Each replica group's stage types in order (older results: one list of names)."""
    groups = types if types and isinstance(types[0], list) else [types]
    return " + ".join(" > ".join(group) for group in groups)


def _idle(r: dict) -> str:
    idle = r.get("idle_by_type")
    if idle is None:
        return "-"
    return ", ".join(f"{n} {t}" for t, n in idle.items()) or "none"


def _efficiency(r: dict) -> str:
    found = (r.get("heterogeneity") or {}).get("efficiency")
    return "-" if found is None else f"{found:.2f}"


def _reference_lines(r: dict) -> list[str]:
    """How a row's heterogeneity efficiency came about: each type's homogeneous fraction and weight."""
    h = r.get("heterogeneity")
    if not h:
        return []
    parts = ", ".join(f"{t} {v['homogeneous_fraction']:.3f} (weight {v['weight']:.2f})"
                      for t, v in h["by_type"].items())
    return [f"Homogeneous reference: {parts}; weighted {h['reference']:.3f}; the plan's fraction over it: "
            f"{_efficiency(r)} (goal >= 0.95).", ""]


def _search_table(data: dict) -> list[str]:
    lines = [
        "## Search time and plan quality (2 sequences per device, catalog costs)",
        "",
        "| devices | types | model | search s (cpu) | simulated | best plan | tokens/s | "
        + " | ".join(f"vs {n}" for n in NAMES)
        + " | vs best single-type | of bound | heterogeneity efficiency |",
        "|---:|---:|---|---:|---:|---|---:|" + "---:|" * len(NAMES) + "---:|---:|---:|",
    ]
    for r in data["search"]:
        if not r.get("fits"):
            lines.append(
                f"| {r['devices']} | {r['types']} | {r['model']} | {r['search_cpu_s']:.1f} | - | "
                "fits nowhere | - | " + "- | " * len(NAMES) + "- | - | - |"
            )
            continue
        v = r["versus"] if "baselines" in r else {}  # older rows measured the former baselines
        lines.append(
            f"| {r['devices']} | {r['types']} | {r['model']} | {r['search_cpu_s']:.1f} | {r['simulated']} | "
            f"{r['plan']} | {r['tokens_per_s']:,.0f} | " + " | ".join(_fmt(v.get(n)) for n in NAMES)
            + f" | {_fmt(r.get('versus_best_single_type'))} | {r['aggregate_fraction']:.0%} "
            f"| {_efficiency(r)} |"
        )
    lines += ["", "Heterogeneity efficiency (mixed rows): the plan's fraction of the aggregate bound over "
              "the weighted fraction the same search reaches on homogeneous clusters of each type (as "
              "many devices, same samples per device, the synthetic clusters' shape; weights: each "
              "type's share of the mixed cluster's bound). A plan with ` + ` between pipeline shapes "
              "runs replica groups of their own shape."]
    timed = sorted({len(r["search_cpu_runs"]) for r in data["search"] if r.get("search_cpu_runs")})
    if timed:
        lines += ["", "Search seconds: the least CPU time of "
                  + " or ".join(map(str, timed)) + " searches, each in a fresh process (the machine is "
                  "shared; every run is in the JSON's `search_cpu_runs`)."]
    made = sorted({f"`{r['provenance']['commit']}`" for r in data["search"] if r.get("provenance")})
    if made:
        lines += ["", f"Rows measured at {', '.join(made)}, each with its own command in the JSON."]
    old = [r for r in data["search"] if "baselines" not in r and not r.get("provenance")]
    if old:
        lines += [
            "",
            f"{len(old)} rows ({', '.join(str(d) for d in sorted({r['devices'] for r in old}))} devices) "
            "are from before the baselines took their systems' shapes (commit not recorded; their "
            "baseline columns show '-'): rerun them with `python bench/planner.py --sections search`.",
        ]
    return [*lines, ""]


def _ablation_table(data: dict) -> list[str]:
    rows = [r for r in _fitting(data) if r.get("ablation")]
    if not rows:
        return []
    lines = [
        "## Ablation: each freedom taken away alone (a constrained search each, simulated)",
        "",
        "Step seconds of the best plan found without the freedom, and in brackets its share of the best "
        "plan's gain over the best baseline, ln(step / best) / ln(baseline / best). Shares of independent "
        "removals need not add up; above 100% the constrained plan is slower than the best baseline; "
        "below 0% the constrained search found a plan the planner's pruning missed.",
        "",
        "| devices | model | best s | best baseline | baseline s | "
        + " | ".join(STEP_TITLES[s] for s in STEPS) + " |",
        "|---:|---|---:|---|---:|" + "---:|" * len(STEPS),
    ]
    for r in rows:
        a = r["ablation"]
        cells = []
        for step in STEPS:
            got = a["steps"][step]
            share = "" if got["share_of_gain"] is None else f" ({got['share_of_gain']:.0%})"
            cells.append(f"{_fmt(got['step_time_s'], '.3f')}{share}")
        lines.append(
            f"| {r['devices']} | {r['model']} | {r['step_time_s']:.3f} | {a['best_baseline'] or '-'} | "
            f"{_fmt(a['best_baseline_step_time_s'], '.3f')} | " + " | ".join(cells) + " |"
        )
    return [*lines, ""]


def _pruning_table(data: dict) -> list[str]:
    lines = [
        "## Loss from pruning against the reference search",
        "",
        "Not an optimality gap: the reference (medley.search.report.reference_search) searches every "
        "structure, family, split rule, micro-batch rule and ZeRO ladder, enumerates all splits x memory "
        "options per stage of its small seeds and searches locally around the others; tp: every uniform "
        "degree and the per-type degrees (which the planner leaves out), and one-rank tp changes in the "
        "local search, not every per-rank combination.",
        "",
        "| case | model | global batch | costs | planner tokens/s | reference tokens/s | loss | "
        "planner sims | reference sims | seeds enumerated | complete | reference s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in data["pruning"]:
        lines.append(
            f"| {r['case']} | {r['model']} | {r['global_batch']} | {r['costs']} | "
            f"{r['planner_tokens_per_s']:,.0f} | {r['reference_tokens_per_s']:,.0f} | "
            f"{_fmt(r['loss_from_pruning'], '.1%')} | {r['planner_simulated']} | "
            f"{r['reference_simulated']} | "
            f"{r['reference_enumerated_seeds']} | {'yes' if r['reference_complete'] else 'budget spent'} | "
            f"{r['reference_wall_s']:.0f} |"
        )
    return [*lines, ""]


def _bound_table(data: dict) -> list[str]:
    lines = [
        "## Fraction of the aggregate bound",
        "",
        "| cluster | model | samples per device | tokens/s | aggregate bound | fraction | vs best baseline |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["bound"]:
        lines.append(
            f"| {r['case']} | {r['model']} | {r['samples_per_device']} | {r['tokens_per_s']:,.0f} | "
            f"{r['aggregate_tokens_per_s']:,.0f} | {r['aggregate_fraction']:.0%} | "
            f"{_fmt(r['versus_best_baseline'])} |"
        )
    return [*lines, ""]


def _profiles_table(data: dict) -> list[str]:
    made = data.get("provenance", {}).get("profiles")
    how = f"Commit `{made['commit']}`, command `{made['command']}`." if made else ""
    lines = ["## Searches on measured profiles (Metis format, A100-40GB + V100-16GB, 8 x 2,048 per device)",
             "", how, "",
             "| cluster | model | profiles | search s (cpu; fresh runs) | best plan | tokens/s | of bound |",
             "|---|---|---|---|---|---:|---:|"]
    for r in data["profiles"]:
        runs = ", ".join(f"{s:.2f}" for s in r["search_cpu_runs"]) or "none"
        lines.append(f"| {r['cluster']} | {r['model']} | {r['profiles']} | {r['search_cpu_s']:.2f} "
                     f"({runs}) | {r['plan']} | {r['tokens_per_s']:,.0f} | {r['aggregate_fraction']:.0%} |")
    return [*lines, ""]


def markdown(data: dict) -> str:
    lines = ["# Planner benchmark", "", f"Machine: {data['machine']}", "", *_provenance(data), ""]
    said = summary(data)
    if said:
        lines += ["## Summary", "", *said, ""]
    if data.get("search"):
        lines += _search_table(data) + _ablation_table(data)
    if data.get("large"):
        lines += _large_section(data)
    if data.get("profiles"):
        lines += _profiles_table(data)
    if data.get("pruning"):
        lines += _pruning_table(data)
    if data.get("bound"):
        lines += _bound_table(data)
    return "\n".join(lines)
