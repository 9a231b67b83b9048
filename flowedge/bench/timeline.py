"""Pipeline timeline plot: one row per device and link, bars coloured by phase.

Several strategies are stacked as panels on one time axis, so a reader sees at a glance which one
keeps every stage busy and which leaves bubbles.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

import click
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from flowedge.sim.trace import Trace, TraceEvent

log = logging.getLogger(__name__)

# Fixed colours for the phases the engine emits, so every plot reads the same way.
PHASE_COLORS = {
    "prefill": "#7f7f7f",
    "draft": "#1f77b4",
    "init-segment": "#2ca02c",
    "expansion": "#98df8a",
    "verify": "#d62728",
    "prune": "#9467bd",
    "ar": "#ff7f0e",
    "level": "#393b79",
    "chain": "#637939",
    "idle-wait": "#e0e0e0",
}
EXTRA_COLORS = ["#8c564b", "#e377c2", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#c5b0d5"]
DEVICE_ROW = 1.0
LINK_ROW = 0.45


def plot_timeline(
    trace: Trace | dict[str, Trace], out_png: Path, *, title: str, max_s: float | None = None
) -> Path:
    """Draw one trace, or one panel per strategy sharing the time axis, into a PNG."""
    panels = trace if isinstance(trace, dict) else {"": trace}
    colors = phase_colors(ev.phase for t in panels.values() for ev in t)
    end_s = max_s or max((ev.end_s for t in panels.values() for ev in t), default=1.0)
    heights = [_lanes_height(t) + 0.8 for t in panels.values()]
    fig = Figure(figsize=(13, min(1.6 + 0.42 * sum(heights), 40)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)
    for ax, (name, tr) in zip(axes[:, 0], panels.items()):
        _draw_panel(ax, name, tr, colors)
    bottom = axes[-1, 0]
    bottom.set_xlim(0, end_s)
    bottom.set_xlabel("time (s, simulated clock)")
    fig.suptitle(title, fontsize=12)
    handles = [Patch(color=c, label=p) for p, c in colors.items()]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 9), frameon=False)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    log.info("wrote timeline %s", out_png)
    return out_png


def phase_colors(phases: Iterable[str]) -> dict[str, str]:
    """Colour per phase present, known phases in engine order, unknown ones after."""
    present = set(phases)
    colors = {p: c for p, c in PHASE_COLORS.items() if p in present}
    for i, phase in enumerate(sorted(present - set(PHASE_COLORS))):
        colors[phase] = EXTRA_COLORS[i % len(EXTRA_COLORS)]
    return colors


def ordered_lanes(lanes: Iterable[str]) -> list[str]:
    """Devices first (node0, stage1, stage2 … in numeric order), then the links."""
    lanes = set(lanes)
    devices = sorted((l for l in lanes if not l.startswith("link")), key=_natural_key)
    links = sorted((l for l in lanes if l.startswith("link")), key=_natural_key)
    return devices + links


def _draw_panel(ax: Axes, name: str, trace: Trace, colors: dict[str, str]) -> None:
    lanes = ordered_lanes(trace.lanes())
    centers, y = {}, 0.0
    for lane in reversed(lanes):  # bottom-up, so the first lane is drawn at the top
        h = _row(lane)
        centers[lane] = y + h / 2
        y += h
    busy = trace.busy_fraction()
    for ev in trace:
        _draw_event(ax, ev, centers[ev.lane], colors[ev.phase])
    ax.set_yticks([centers[l] for l in lanes])
    ax.set_yticklabels([f"{l}  {busy.get(l, 0.0):4.0%}" for l in lanes], fontsize=8)
    for lane, tick in zip(lanes, ax.get_yticklabels()):
        if lane.startswith("link"):
            tick.set_color("#555555")
    ax.set_ylim(0, max(y, 1.0))
    ax.grid(axis="x", alpha=0.3)
    label = f"{name}: " if name else ""
    ax.set_title(f"{label}makespan {trace.makespan_s():.2f} s (label: lane, busy %)", fontsize=9, loc="left")


def _draw_event(ax: Axes, ev: TraceEvent, center: float, color: str) -> None:
    row = _row(ev.lane)
    height = row * (0.8 if ev.kind == "compute" else 0.45)
    idle = ev.phase == "idle-wait"
    ax.broken_barh(
        [(ev.start_s, max(ev.duration_s, 1e-9))],
        (center - height / 2, height),
        facecolors=color,
        edgecolors="#999999" if idle else "none",
        hatch="//" if idle else None,
        linewidth=0.3,
    )


def _row(lane: str) -> float:
    return LINK_ROW if lane.startswith("link") else DEVICE_ROW


def _lanes_height(trace: Trace) -> float:
    return sum(_row(l) for l in trace.lanes()) or 1.0


def _natural_key(lane: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", lane)]


@click.command("plot-trace")
@click.argument("trace_json", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_png", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--title", default="", help="Figure title (default: the file name).")
@click.option("--max-s", type=float, default=None, help="Clip the time axis at this many seconds.")
def plot_trace_command(trace_json: Path, out_png: Path, title: str, max_s: float | None) -> None:
    """Plot a saved trace: a JSON list of events, or {strategy: [events]} for stacked panels."""
    data = json.loads(trace_json.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        trace: Trace | dict[str, Trace] = {name: Trace.from_json(events) for name, events in data.items()}
    else:
        trace = Trace.from_json(data)
    plot_timeline(trace, out_png, title=title or trace_json.name, max_s=max_s)
    click.echo(str(out_png))
