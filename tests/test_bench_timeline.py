"""Timeline PNGs from synthetic traces."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from flowedge.bench.timeline import PHASE_COLORS, ordered_lanes, phase_colors, plot_timeline, plot_trace_command
from flowedge.sim.trace import Trace, TraceEvent


def _pipeline(stages: int, segments: int, overlap: bool) -> Trace:
    tr, t = Trace(), 0.0
    for seg in range(segments):
        ready = t
        tr.add(TraceEvent("node0", "compute", "draft", ready, ready + 0.02, tokens=16))
        ready += 0.02
        for s in range(1, stages + 1):
            tr.add(TraceEvent(f"link{s - 1}->{s}", "transfer", "init-segment", ready, ready + 0.002, nbytes=9000))
            ready += 0.002
            tr.add(TraceEvent(f"stage{s}", "compute", "expansion" if seg else "init-segment", ready, ready + 0.05))
            ready += 0.05
        tr.add(TraceEvent("node0", "compute", "verify", ready, ready + 0.01))
        t = t + 0.052 if overlap else ready + 0.01
    return tr


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_trace_png(tmp_path: Path) -> None:
    out = plot_timeline(_pipeline(4, 3, overlap=False), tmp_path / "sub" / "one.png", title="naive")
    assert out.is_file() and _is_png(out) and out.stat().st_size > 20_000


def test_stacked_panels_png_with_max_s(tmp_path: Path) -> None:
    traces = {"naive-pp": _pipeline(4, 3, overlap=False), "flowspec": _pipeline(4, 6, overlap=True)}
    traces["flowspec"].add(TraceEvent("stage2", "compute", "custom-phase", 0.9, 0.95))
    out = plot_timeline(traces, tmp_path / "both.png", title="strategies", max_s=1.0)
    assert _is_png(out) and out.stat().st_size > 30_000


def test_lane_order_devices_first_numeric() -> None:
    lanes = ["link10->0", "stage10", "link0->1", "stage2", "node0", "stage1"]
    assert ordered_lanes(lanes) == ["node0", "stage1", "stage2", "stage10", "link0->1", "link10->0"]


def test_palette_is_stable_and_covers_unknown_phases() -> None:
    colors = phase_colors(["verify", "zeta", "draft", "alpha"])
    assert list(colors) == ["draft", "verify", "alpha", "zeta"]
    assert colors["verify"] == PHASE_COLORS["verify"]
    assert len(set(colors.values())) == 4


def test_plot_trace_command_reads_saved_json(tmp_path: Path) -> None:
    src = tmp_path / "trace.json"
    src.write_text(json.dumps({"a": _pipeline(2, 2, False).to_json(), "b": _pipeline(2, 3, True).to_json()}))
    result = CliRunner().invoke(plot_trace_command, [str(src), str(tmp_path / "t.png"), "--max-s", "0.5"])
    assert result.exit_code == 0, result.output
    assert _is_png(tmp_path / "t.png")
