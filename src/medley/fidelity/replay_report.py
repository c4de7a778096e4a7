"""The replay and core-share sections of the fidelity report (:mod:`medley.fidelity.fidelity_report`),
rendered from the results alone, with the goals they are held to."""

from __future__ import annotations

from collections.abc import Sequence

from medley.fidelity.results import FidelityResult, replay_summary

REPLAY_MEDIAN_GOAL = 0.03  # median |replay step error| over all cases (issue 29)
REPLAY_WORST_GOAL = 0.10  # worst case
END_TO_END_GOAL = 0.10  # median |error| against the median step, cases within the cores


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _ms(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2] * 1e3:.1f}" if ordered else "-"


def replay_table(results: Sequence[FidelityResult]) -> list[str]:
    """Per case: the replayed and measured steps (medians) and the replay's errors."""
    lines = [
        "| case | ranks | replay ms | measured ms | start skew ms | replay err (median of steps) "
        "| median abs | worst step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        errors = r.replay_errors
        worst = max(errors, key=abs) if errors else float("nan")
        lines.append(f"| {r.case} | {r.world} | {_ms(r.replay_step_s)} | {_ms(r.replay_measured_s)} "
                     f"| {r.replay_skew_s * 1e3:.2f} "
                     f"| {_pct(r.replay_error)} | {r.replay_abs_error:.1%} | {_pct(worst)} |")
    return lines


def feature_table(results: Sequence[FidelityResult]) -> list[str]:
    """Per feature (tag): the replay figures over its cases, and the end-to-end ones."""
    by_feature = replay_summary(results)["by_feature"]
    lines = [
        "| feature | cases | replay median err | replay median abs | replay worst abs "
        "| end-to-end median abs (median step) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for tag, f in by_feature.items():
        lines.append(f"| {tag} | {f['cases']} | {_pct(f['median_replay_error'])} "
                     f"| {f['median_abs_replay_error']:.1%} | {f['worst_abs_replay_error']:.1%} "
                     f"| {f['median_abs_step_error']:.1%} |")
    return lines


def misses(results: Sequence[FidelityResult]) -> list[str]:
    """The features whose replay misses the goals, and by how much (empty: none does)."""
    out = []
    for tag, f in replay_summary(results)["by_feature"].items():
        over = []
        if f["median_abs_replay_error"] > REPLAY_MEDIAN_GOAL:
            over.append(f"median |error| {f['median_abs_replay_error']:.1%} (goal {REPLAY_MEDIAN_GOAL:.0%}, "
                        f"signed {f['median_replay_error']:+.1%})")
        if f["worst_abs_replay_error"] > REPLAY_WORST_GOAL:
            worst = max((r for r in results if tag in r.tags), key=lambda r: r.replay_abs_error)
            over.append(f"worst {f['worst_abs_replay_error']:.1%} (goal {REPLAY_WORST_GOAL:.0%}; "
                        f"{worst.case}, {worst.replay_error:+.1%})")
        if over:
            out.append(f"- {tag} ({f['cases']} cases): " + "; ".join(over))
    return out


def replay_lines(results: Sequence[FidelityResult]) -> list[str]:
    """The replay section: what it is, the figures against the goals, the tables."""
    if not any(r.replay_step_s for r in results):
        return []  # a report from before replay
    s = replay_summary(results)
    met = (s["median_abs_replay_error"] <= REPLAY_MEDIAN_GOAL
           and s["worst_abs_replay_error"] <= REPLAY_WORST_GOAL)
    lines = [
        "## Replay: the simulator on each step's own measured compute",
        "",
        "Each timed step is simulated again with the compute durations that step measured on every "
        "rank (F, B, W, BW with their emulation sleeps and the posting of the sends after them, and "
        "OPTIM; medley.fidelity.replay); transfers, ZeRO collectives and the clipping all-reduce "
        "stay modelled; each rank starts at the skew it was measured at, and the replayed step is set "
        "against the measured one from the first rank's start to the last rank's end. What is left is "
        "the error of the simulator's dependency, transfer, collective "
        "and overhead model, without this machine's compute noise.",
        "",
        f"Over {len(results)} cases ({s['replayed_steps']} steps): median |replay error| "
        f"{s['median_abs_replay_error']:.1%} (goal {REPLAY_MEDIAN_GOAL:.0%}), worst case "
        f"{s['worst_abs_replay_error']:.1%} (goal {REPLAY_WORST_GOAL:.0%}), median signed "
        f"{s['median_replay_error']:+.1%}; worst single step {s['worst_abs_replay_step_error']:.1%}. "
        + ("The goals are met." if met else "The goals are not met."),
        "",
        *replay_table(results),
        "",
    ]
    missed = misses(results)
    if missed:
        lines += ["Features whose replay misses a goal:", "", *missed, ""]
    return lines + ["Per feature (a case counts for every feature it has):", "", *feature_table(results), ""]


def cores_lines(results: Sequence[FidelityResult]) -> list[str]:
    """The end-to-end figure on the cases whose ranks each had a core, and on the others."""
    if not any(r.world for r in results):
        return []
    s = replay_summary(results)
    cores = max(r.cores for r in results)
    within = s["median_abs_step_error_within_cores"]
    verdict = "" if within != within else (" (goal met)" if within <= END_TO_END_GOAL else " (goal not met)")
    return [
        "## End to end, by whether the ranks had a core each",
        "",
        f"Each rank computes with one thread (torch.set_num_threads(1) in every launched rank); this "
        f"machine has {cores} cores. On the {s['cases_within_cores']} cases with no more ranks than "
        f"cores the prediction from profiles is off by a median |error| of {within:.1%} against the "
        f"median step{verdict}, goal {END_TO_END_GOAL:.0%} (worst "
        f"{s['worst_abs_step_error_within_cores']:.1%}; against the fastest step "
        f"{s['median_abs_fastest_step_error_within_cores']:.1%}). The {s['cases_sharing_cores']} cases "
        f"with more ranks than cores are predicted with the core-sharing stretch "
        f"(medley.fidelity.emulate.core_share) and are off by a median "
        f"{s['median_abs_step_error_sharing_cores']:.1%} "
        f"(worst {s['worst_abs_step_error_sharing_cores']:.1%}).",
        "",
    ]
