"""Progress an operator can see: a tqdm bar on a terminal, throttled plain log lines elsewhere (or
with TQDM_DISABLE), and `flowedge up` following its nodes' logs."""
from __future__ import annotations

import io
import logging
import time

from flowedge.progress import NodeProgress, Progress, ProgressTail, Ticker


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_are_throttled_plain_and_end_with_done(caplog, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    caplog.set_level(logging.INFO, "flowedge.progress")
    out = io.StringIO()
    bar = Progress("splitting m", 10_000_000, stream=out, interval_s=60.0)
    for done in range(0, 10_000_001, 1_000_000):
        bar.update(done)
    bar.finish()
    bar.finish()   # once only
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2   # the first update; reaching the total ends it (once)
    assert lines[0].startswith("progress: splitting m:   0%|") and "0.00/10.0M" in lines[0]
    assert lines[-1].endswith(" done") and "100%|####" in lines[-1] and "10.0M/10.0M" in lines[-1]
    assert not any("\r" in line for line in lines) and out.getvalue() == ""


def test_terminal_gets_a_tqdm_bar_redrawn_in_place(caplog):
    caplog.set_level(logging.INFO, "flowedge.progress")
    out = FakeTTY()
    bar = Progress("downloading m", 4_000_000, stream=out, interval_s=0.0)
    bar.update(1_000_000)
    bar.finish()
    text = out.getvalue()
    assert text.count("\r") >= 2 and text.endswith("\n")
    assert "downloading m:  25%|" in text and "1.00M/4.00M" in text
    assert "downloading m: 100%|" in text and "4.00M/4.00M" in text
    assert not caplog.records      # a bar, not log lines


def test_tqdm_disable_gives_log_lines_on_a_terminal(caplog, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    caplog.set_level(logging.INFO, "flowedge.progress")
    out = FakeTTY()
    bar = Progress("training", 10, unit="steps", stream=out, interval_s=0.0)
    bar.update(5)
    bar.finish()
    assert out.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("progress: training:  50%|") and "| 5/10 [" in lines[0] and "steps/s]" in lines[0]
    assert lines[-1].startswith("progress: training: 100%|") and "| 10/10 [" in lines[-1]
    assert lines[-1].endswith(" done")


def test_ticker_reports_a_silent_step(caplog):
    caplog.set_level(logging.INFO, "flowedge.progress")
    with Ticker("converting m: reading the GGUF", interval_s=0.05):
        time.sleep(0.18)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("(started)") and lines[-1].endswith("(00:00) done")
    assert any("so far" in line for line in lines[1:-1])


def test_tail_shows_only_new_whole_progress_lines(tmp_path):
    head = tmp_path / "head.log"
    head.write_text("2026 INFO old run progress: x 10.0% (old)\n")
    seen: list[tuple[str, str]] = []
    tail = ProgressTail([head, tmp_path / "stage-1.log"], lambda node, line: seen.append((node, line)))
    with open(head, "a") as f:
        f.write("2026 INFO flowedge.progress: progress: converting m:   5%|#  | 1.0M/20.0M\n")
        f.write("2026 INFO flowedge.node: something else\n")
        f.write("2026 INFO flowedge.progress: progress: converting m:  50%|#####")   # not yet a whole line
    tail.poll()
    assert seen == [("head", "converting m:   5%|#  | 1.0M/20.0M")]
    with open(head, "a") as f:
        f.write(" | 10.0M/20.0M\n")
    (tmp_path / "stage-1.log").write_text("progress: fetching shard ab: 100%|####| 2.0M/2.0M done\n")
    tail.poll()
    assert seen[1:] == [("head", "converting m:  50%|##### | 10.0M/20.0M"),
                        ("stage-1", "fetching shard ab: 100%|####| 2.0M/2.0M done")]


def test_node_progress_plain_lines_when_piped():
    out = io.StringIO()
    shown = NodeProgress(out)
    shown("head", "converting m:  50%|##### | 10.0M/20.0M")
    shown.note("  waiting for the head (loading models)")
    shown.close()
    assert out.getvalue() == "  head: converting m:  50%|##### | 10.0M/20.0M\n  waiting for the head (loading models)\n"


def test_node_progress_on_a_terminal_keeps_a_status_line(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    tty = FakeTTY()
    shown = NodeProgress(tty)
    shown("head", "converting m:  50%|##### | 10.0M/20.0M")
    shown("stage-1", "fetching shard ab: 100%|####| 2.0M/2.0M done")
    shown.note("  1/2 stages ready")
    shown.close()
    text = tty.getvalue()
    assert "\r  head: converting m:  50%" in text                       # redrawn in place
    assert "  stage-1: fetching shard ab: 100%|####| 2.0M/2.0M done\n" in text   # a finished step stays
    assert "  1/2 stages ready\n" in text
