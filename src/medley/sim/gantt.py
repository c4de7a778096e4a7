"""A PNG Gantt chart of one simulated step (matplotlib, Agg backend).

One row per device (its id and, given the cluster, its type): compute actions as full-height bars
in fixed colours per kind, labelled with the micro-batch when the bar is wide enough; underneath, a
thin strip with outgoing transfers and collectives. The legend names only the kinds drawn.
Readable up to 16 devices.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from medley.schedule.ir import Kind  # noqa: E402
from medley.sim.result import DeviceReport, SimResult  # noqa: E402
from medley.spec.cluster import Cluster  # noqa: E402

COLOURS = {
    Kind.F: "#4C72B0",
    Kind.B: "#55A868",
    Kind.W: "#DD8452",
    Kind.BW: "#8172B3",
    Kind.OPTIM: "#7F7F7F",
    "p2p": "#C44E52",
    "collective": "#8C2D04",
}
_LEGEND = [
    (Kind.F, "F forward"), (Kind.B, "B input grad"), (Kind.W, "W weight grad"), (Kind.BW, "BW full backward"),
    (Kind.OPTIM, "optimizer"), ("p2p", "send"), ("collective", "ZeRO collective"),
]


def _time_scale(step: float) -> tuple[float, str]:
    if step >= 10:
        return 1.0, "s"
    if step >= 1e-2:
        return 1e3, "ms"
    return 1e6, "µs"


def _row_label(report: DeviceReport, types: dict[int, str], roles: dict[int, str]) -> str:
    """``dev 8 T4-16GB (r0 k0)``, the type where known, the role on a second line."""
    name = f"dev {report.device}" + (f" {types[report.device]}" if report.device in types else "")
    return f"{name} ({report.label})" + (f"\n{roles[report.device]}" if report.device in roles else "")


def write_gantt(result: SimResult, path: str | Path, *, title: str | None = None,
                roles: dict[int, str] | None = None, cluster: Cluster | None = None) -> Path:
    """Draw ``result`` to a PNG at ``path`` and return the path (:func:`gantt_figure`)."""
    path = Path(path)
    fig = gantt_figure(result, title=title, roles=roles, cluster=cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def gantt_figure(result: SimResult, *, title: str | None = None, roles: dict[int, str] | None = None,
                 cluster: Cluster | None = None) -> Figure:
    """The chart of ``result``, not yet saved (close it with ``plt.close``). ``cluster``, the one
    simulated, names each row's device type; the legend lists only the kinds of bars drawn."""
    reports = result.devices
    scale, unit = _time_scale(result.step_time_s)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(reports)), dpi=110)
    row_of = {report.device: i for i, report in enumerate(reports)}
    width_per_label = result.step_time_s * scale / 140  # ~ the width one or two digits need
    drawn: set[Kind | str] = set()
    for device, timeline in result.compute.items():
        y = row_of[device]
        spans = [((s * scale), (e - s) * scale) for s, e, _ in timeline]
        colours = [COLOURS.get(a.kind, "#BBBBBB") for _, _, a in timeline]
        drawn |= {a.kind for start, end, a in timeline if end > start}
        ax.broken_barh(spans, (y - 0.4, 0.6), facecolors=colours, edgecolor="white", linewidth=0.3)
        for (x, w), (_, _, action) in zip(spans, timeline, strict=True):
            if action.micro_batch is not None and w >= width_per_label * len(str(action.micro_batch)):
                ax.text(x + w / 2, y - 0.1, str(action.micro_batch), ha="center", va="center", fontsize=6,
                        color="white")
    comm: dict[int, list[tuple[tuple[float, float], str]]] = {}
    for src, _, start, end, *_ in result.transfers:
        if end > start:  # with communication off every transfer takes no time: nothing to draw
            comm.setdefault(src, []).append(((start * scale, (end - start) * scale), COLOURS["p2p"]))
            drawn.add("p2p")
    for members, start, end, _ in result.collectives:
        if end > start:
            bar = ((start * scale, (end - start) * scale), COLOURS["collective"])
            for device in members:
                comm.setdefault(device, []).append(bar)
            drawn.add("collective")
    for device, bars in comm.items():
        ax.broken_barh([b for b, _ in bars], (row_of[device] + 0.25, 0.15), facecolors=[c for _, c in bars])
    ax.set_yticks(range(len(reports)))
    types = {device.id: device.type.name for device in cluster.devices} if cluster is not None else {}
    ax.set_yticklabels([_row_label(r, types, roles or {}) for r in reports], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, result.step_time_s * scale)
    ax.set_xlabel(f"time ({unit})")
    summary = f"step {result.step_time_s * scale:.4g} {unit}, bubble {result.bubble_fraction:.1%}"
    if result.mfu:
        summary += f", MFU {result.mfu:.1%}"
    ax.set_title(f"{title}: {summary}" if title else summary, fontsize=10)
    legend = [Patch(color=COLOURS[k], label=label) for k, label in _LEGEND if k in drawn]
    if legend:
        ax.legend(handles=legend, loc="upper center",
                  bbox_to_anchor=(0.5, -0.12 if len(reports) > 4 else -0.3),
                  ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
