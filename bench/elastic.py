"""Elastic recovery on CPU: how long a lost node and a returning one cost (three emulated nodes).

``medley launch PLAN --elastic --local`` on three one-device nodes (the tiny model, a global
batch of 12, 20 steps, a checkpoint every 5, every device slowed 30x so that a step lasts about a
second on 2 cores). Node c's agent is killed with ``kill -9`` once step 6 runs, then started again
(``--local --node c``) once the run goes on without it. Per repeat it records the time from the
kill to the end of the first step under the new plan (what a user waits), the same from the last
heartbeat before the event (the run's own ``recovery_s``), the steps redone, and the join's. The
scenario is the one of tests/runtime/test_elastic_launch.py, whose helpers it uses.

    python bench/elastic.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from provenance import provenance

from medley.testing.elastic_scenario import (
    SLOW,
    events,
    final_records,
    kill_node_at,
    launch,
    make_plan,
    three_nodes,
    token_file,
    train_flags,
    wait_for,
)

ROOT = Path(__file__).parents[1]
OUT = ROOT / "bench" / "results"

FIELDS = ("old_plan", "new_plan", "recovery_s", "steps_redone", "resumed_from")
GOAL_S = 60.0  # the goal for the time from the kill to the first new step, 2 cores


def once(directory: Path) -> dict:
    plan, data = make_plan(directory, three_nodes(directory)), token_file(directory)
    flags = train_flags(directory, data, "--slowdown", SLOW)
    started = time.time()
    run = launch(directory, plan, flags)
    killed = kill_node_at(run, "c", 6)
    wait_for(lambda: len(events(run)) == 1, what="the re-plan", run=run)
    back = launch(directory, plan, flags, node="c", endpoint=run.endpoint, rdzv_id=run.rdzv_id)
    code, err = run.finish(timeout=600)
    back_code, _ = back.finish(timeout=600)
    if code or back_code:
        raise SystemExit(f"the elastic run failed ({code}, {back_code}): {err[-2000:]}")
    lost, joined = events(run)
    records = final_records(directory)
    return {"seconds": round(time.time() - started, 2), "steps": len(records),
            "kill_to_first_new_step_s": round(lost["first_step_at"] - killed, 2),
            "lost": {k: lost[k] for k in FIELDS}, "joined": {k: joined[k] for k in FIELDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict = {**provenance(), "goal_s": GOAL_S, "runs": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results["runs"].append(once(Path(tmp)))
    OUT.mkdir(exist_ok=True)
    (OUT / "elastic.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "elastic.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    rows = ["| run | kill to first new step s | event to first step s (lost) | steps redone (lost) | "
            "event to first step s (joined) | steps redone (joined) | plans | whole run s |",
            "|---|---|---|---|---|---|---|---|"]
    for index, run in enumerate(results["runs"]):
        lost, joined = run["lost"], run["joined"]
        rows.append(f"| {index + 1} | {run['kill_to_first_new_step_s']} | {lost['recovery_s']} | "
                    f"{lost['steps_redone']} | {joined['recovery_s']} | {joined['steps_redone']} | "
                    f"{lost['old_plan']} -> {lost['new_plan']} -> {joined['new_plan']} | {run['seconds']} |")
    kills = [r["kill_to_first_new_step_s"] for r in results["runs"]]
    joins = [r["joined"]["recovery_s"] for r in results["runs"]]
    prose = (f"From the `kill -9` to the end of the first step under the new plan: median "
             f"{statistics.median(kills):.1f} s, worst {max(kills):.1f} s over {len(kills)} runs (goal "
             f"<= {results['goal_s']:g} s on 2 cores: "
             f"{'met' if max(kills) <= results['goal_s'] else 'missed'}). "
             f"A returning node costs a median {statistics.median(joins):.1f} s from the checkpoint it was "
             "admitted at to the first step with it, and redoes "
             f"{max(r['joined']['steps_redone'] for r in results['runs'])} steps.")
    head = f"Commit `{results.get('commit', '?')}`, command `{results.get('command', '?')}`.\n\n"
    title = "# Elastic recovery (CPU, three emulated nodes)\n\n"
    return title + head + "\n".join(rows) + "\n\n" + prose + "\n"


if __name__ == "__main__":
    main()
