"""The runtime equals single-process training: loss and gradients within 1e-5 (fp32), parameters
after SGD steps within 1e-5, for pipeline x ZeRO plans run on gloo with up to 4 ranks.

Each launch runs many plans in one process group (a launch costs seconds); a watchdog in every
rank and pytest-timeout turn a hang into a failure.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp
from equality_worker import Case, run_case, worker

from medley.launch.nodes import free_port
from medley.schedule.generators import generate
from medley.schedule.ir import B, F, PipelineSchedule, W, loop_stage_to_rank

TOL = 1e-5


def zb_h1(pp: int, micro_batches: int) -> PipelineSchedule:
    """1F1B with the backward split: stage s defers each W by pp-1-s backwards (ZB-H1 shape)."""
    rows = []
    for stage, row in enumerate(generate("1f1b", pp=pp, micro_batches=micro_batches).actions):
        out, delay, done = [], pp - 1 - stage, 0
        for action in row:
            if action.kind.value == "BW":
                out.append(B(stage, action.micro_batch))
                if action.micro_batch - delay >= 0:
                    out.append(W(stage, action.micro_batch - delay))
                    done += 1
            else:
                out.append(F(stage, action.micro_batch))
        out += [W(stage, i) for i in range(done, micro_batches)]
        rows.append(out)
    return PipelineSchedule(family="zb-h1", num_stages=pp, num_micro_batches=micro_batches,
                            stage_to_rank=loop_stage_to_rank(pp), actions=rows)


def launch(world: int, cases: list[Case], tmp_path,
           body: Callable[[Case], dict] = run_case) -> dict[str, dict]:
    """Run ``body`` on every case of ``world`` ranks in one process group; per case, each figure's
    largest value over the ranks (strings: the last rank's)."""
    out = tmp_path / f"results_{world}.json"
    # Ranks come from the fork server (a clean process with torch imported), as `medley train`'s do:
    # a fork of pytest itself, which has run torch ops, can deadlock on the inherited thread pool.
    multiprocessing.set_forkserver_preload(["torch", "medley.launch.spawn", "equality_worker"])
    mp.start_processes(worker, args=(world, free_port(), cases, str(out), body), nprocs=world, join=True,
                       start_method="forkserver")
    merged: dict[str, dict] = {}
    for rank_results in json.loads(out.read_text()):
        for name, figures in rank_results.items():
            slot = merged.setdefault(name, {})
            for key, value in figures.items():
                slot[key] = value if isinstance(value, str) else max(value, slot.get(key, 0.0))
    return merged


def check(results: dict[str, dict], cases: list[Case]) -> None:
    report = "\n".join(f"{name}: {figures}" for name, figures in results.items())
    print(report)
    for case in cases:
        figures = results.get(case.name)
        assert figures is not None, f"{case.name} did not run\n{report}"
        assert "error" not in figures, f"{case.name} failed:\n{figures['error']}"
        for key in ("loss", "grad", "param1", "param2"):
            assert figures[key] <= TOL, f"{case.name}: {key} differs by {figures[key]:.3g}\n{report}"


def two_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="pp2-1f1b-zero0", pp=2, dp=1, split=(2, 4), zero=(0, 0),
             schedules=[gen("1f1b", pp=2, micro_batches=3)]),
        Case(name="pp2-zbh1-zero3", pp=2, dp=1, split=(3, 3), zero=(3, 3), schedules=[zb_h1(2, 4)]),
        Case(name="dp2-zero3-uneven-mb", pp=1, dp=2, split=(6,), zero=(3,),
             schedules=[gen("gpipe", pp=1, micro_batches=3), gen("gpipe", pp=1, micro_batches=1)]),
        Case(name="dp2-zero1", pp=1, dp=2, split=(6,), zero=(1,),
             schedules=[gen("1f1b", pp=1, micro_batches=2)] * 2),
    ]


@pytest.mark.timeout(240)
def test_two_ranks(tmp_path) -> None:
    cases = two_rank_cases()
    check(launch(2, cases, tmp_path), cases)


def four_rank_cases() -> list[Case]:
    gen = generate
    return [
        Case(name="pp4-1f1b-mixed-zero", pp=4, dp=1, split=(1, 2, 2, 1), zero=(3, 0, 2, 1),
             schedules=[gen("1f1b", pp=4, micro_batches=5)]),
        Case(name="pp2xdp2-zbh1-zero3,1-uneven-mb", pp=2, dp=2, split=(3, 3), zero=(3, 1),
             schedules=[zb_h1(2, 5), zb_h1(2, 3)]),
        Case(name="pp2xdp2-1f1b-zero2,0-uneven-mb", pp=2, dp=2, split=(4, 2), zero=(2, 0),
             schedules=[gen("1f1b", pp=2, micro_batches=4), gen("1f1b", pp=2, micro_batches=2)]),
        Case(name="pp2xdp2-interleaved-zero3,3,1,2", pp=2, dp=2, split=(1, 2, 2, 1), zero=(3, 3, 1, 2),
             schedules=[gen("interleaved", pp=2, micro_batches=4)] * 2),
        Case(name="pp2xdp2-gpipe-zero3-uneven-mb", pp=2, dp=2, split=(2, 4), zero=(3, 3),
             schedules=[gen("gpipe", pp=2, micro_batches=1), gen("gpipe", pp=2, micro_batches=3)]),
    ]


@pytest.mark.timeout(300)
def test_four_ranks(tmp_path) -> None:
    cases = four_rank_cases()
    check(launch(4, cases, tmp_path), cases)


def placed_cases() -> list[Case]:
    """The issue's assignments that are not row-major (#12): the pipeline position and replica
    come from the table, so sends, receives and ZeRO shards must address the plan's peers."""
    gen = generate
    return [
        Case(name="pp2xdp2-1f1b-zero3,1-assignment-3,0;1,2", pp=2, dp=2, split=(3, 3), zero=(3, 1),
             schedules=[gen("1f1b", pp=2, micro_batches=4), gen("1f1b", pp=2, micro_batches=2)],
             table=(((3,), (0,)), ((1,), (2,)))),
        Case(name="pp2xdp2-interleaved-zero2,3,0,1-assignment-1,0;3,2", pp=2, dp=2, split=(1, 2, 2, 1),
             zero=(2, 3, 0, 1), schedules=[gen("interleaved", pp=2, micro_batches=4)] * 2,
             table=(((1,), (0,)), ((3,), (2,)))),
        Case(name="pp4-zbh1-zero0-assignment-2,0,3,1", pp=4, dp=1, split=(1, 2, 2, 1), zero=(0, 0, 0, 0),
             schedules=[zb_h1(4, 5)], table=(((2,), (0,), (3,), (1,)),)),
    ]


@pytest.mark.timeout(300)
def test_placed_assignments(tmp_path) -> None:
    cases = placed_cases()
    check(launch(4, cases, tmp_path), cases)


def zipper_cases() -> list[Case]:
    """Plans whose collectives come from medley's placement pass (buckets, windows, padding)."""
    from medley.schedule.zero import place_collectives
    from medley.schedule.zero_settings import StageZero

    def placed(name: str, split: tuple[int, ...], zero: list[StageZero], schedules: list[PipelineSchedule],
               policy: str) -> Case:
        schedules = place_collectives(schedules, zero, stage_layers=split, policy=policy)
        levels = tuple(z.level for z in zero)
        return Case(name=name, pp=2, dp=2, split=split, zero=levels, schedules=schedules)

    return [
        placed("zipper-bubble-zbh1-zero3,2-buckets-uneven-mb", (3, 3),
               [StageZero(level=3, buckets=2), StageZero(level=2, buckets=3)], [zb_h1(2, 5), zb_h1(2, 3)],
               "bubble"),
        placed("zipper-naive-1f1b-zero3,1-uneven-mb", (2, 4), [StageZero(level=3), StageZero(level=1)],
               [generate("1f1b", pp=2, micro_batches=4), generate("1f1b", pp=2, micro_batches=2)], "naive"),
        placed("zipper-streamed-zero3-uneven-mb", (3, 3),
               [StageZero(level=3, buckets=2, gather_windows=0)] * 2,
               [generate("1f1b", pp=2, micro_batches=4), generate("1f1b", pp=2, micro_batches=2)], "bubble"),
        placed("zipper-bubble-1f1b-zero3-windows", (3, 3),
               [StageZero(level=3, buckets=2, gather_windows=2, grad_windows=2), StageZero(level=3)],
               [generate("1f1b", pp=2, micro_batches=4)] * 2, "bubble"),
    ]


@pytest.mark.timeout(300)
def test_zipper_placement(tmp_path) -> None:
    cases = zipper_cases()
    check(launch(4, cases, tmp_path), cases)
