"""The Gantt chart's row labels name each device's type; its legend lists only the kinds drawn."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from sim_doubles import AlphaBetaComm, uniform_problem
from test_zero import zero3_problem
from typer.testing import CliRunner

import medley.sim.gantt as gantt
from medley.cli.main import app
from medley.schedule.generators import generate
from medley.sim import simulate
from medley.sim.gantt import gantt_figure, write_gantt
from medley.sim.result import SimResult
from medley.spec.cluster_load import parse_cluster_arg

MIXED = "2xA100-80GB+1xV100-32GB+1xT4-16GB"


def _labels(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_yticklabels()]


def _legend(fig: Figure) -> list[str]:
    legend = fig.axes[0].get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def _pipeline(family: str, *, comm: bool = True) -> SimResult:
    # Transfers of 10 bytes at 100 B/s plus 0.1 s take 0.2 s; with comm off they take no time.
    alpha, beta = (0.1, 100.0) if comm else (0.0, float("inf"))
    return simulate(uniform_problem(generate(family, pp=4, micro_batches=4), send_bytes=10.0,
                                    comm=AlphaBetaComm(alpha=alpha, beta=beta)))


def test_rows_name_the_device_type_on_a_mixed_cluster() -> None:
    fig = gantt_figure(_pipeline("1f1b"), cluster=parse_cluster_arg(MIXED), roles={3: "g0 pp4 1f1b"})
    try:
        assert _labels(fig) == ["dev 0 A100-80GB (r0 k0)", "dev 1 A100-80GB (r0 k1)",
                                "dev 2 V100-32GB (r0 k2)", "dev 3 T4-16GB (r0 k3)\ng0 pp4 1f1b"]
    finally:
        plt.close(fig)


def test_rows_without_a_cluster_keep_the_old_labels() -> None:
    fig = gantt_figure(_pipeline("1f1b"))
    try:
        assert _labels(fig) == [f"dev {k} (r0 k{k})" for k in range(4)]
    finally:
        plt.close(fig)


@pytest.mark.parametrize(("result", "expected"), [
    # 1F1B without ZeRO: no W, no optimizer, no collective in the legend.
    (lambda: _pipeline("1f1b"), ["F forward", "BW full backward", "send"]),
    (lambda: _pipeline("zb-h1"), ["F forward", "B input grad", "W weight grad", "send"]),
    # With communication off the transfers take no time: no send bar, no send entry.
    (lambda: _pipeline("1f1b", comm=False), ["F forward", "BW full backward"]),
    (lambda: simulate(zero3_problem()), ["F forward", "BW full backward", "optimizer", "ZeRO collective"]),
], ids=["1f1b", "zb-h1", "1f1b-no-comm", "zero3"])
def test_legend_lists_exactly_the_kinds_drawn(result, expected: list[str]) -> None:
    result = result()
    fig = gantt_figure(result)
    try:
        assert _legend(fig) == expected
        drawn = {a.kind for timeline in result.compute.values() for s, e, a in timeline if e > s}
        assert len(expected) == len(drawn) + any(e > s for _, _, s, e, *_ in result.transfers) + any(
            e > s for _, s, e, _ in result.collectives)
    finally:
        plt.close(fig)


def test_write_gantt_still_writes_a_png(tmp_path: Path) -> None:
    path = write_gantt(_pipeline("1f1b"), tmp_path / "g.png", cluster=parse_cluster_arg(MIXED))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []  # the figure was closed


def test_simulate_command_labels_rows_with_types(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures: list[Figure] = []

    def keep(*args, **kwargs) -> Figure:
        figures.append(gantt_figure(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(gantt, "gantt_figure", keep)
    result = CliRunner().invoke(app, ["simulate", "--cluster", MIXED, "--model", "tiny", "--pp", "4",
                                      "--micro-batches", "4", "--seq-len", "64", "--dtype", "fp16",
                                      "--gantt", str(tmp_path / "g.png"), "--json"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "g.png").stat().st_size > 0
    (fig,) = figures
    assert [label.split(" (")[0] for label in _labels(fig)] == [
        "dev 0 A100-80GB", "dev 1 A100-80GB", "dev 2 V100-32GB", "dev 3 T4-16GB"]
    assert "W weight grad" not in _legend(fig) and "ZeRO collective" not in _legend(fig)
