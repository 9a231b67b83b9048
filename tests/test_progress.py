"""Progress an operator can see: a bar on a terminal, throttled plain log lines elsewhere, and
`flowedge up` following its nodes' logs."""
from __future__ import annotations

import io
import logging
import time

from flowedge.progress import Progress, ProgressTail, TerminalProgress, Ticker, bar_line


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_are_throttled_plain_and_end_with_done(caplog):
    caplog.set_level(logging.INFO, "flowedge.progress")
    bar = Progress("splitting m", 10_000_000, stream=io.StringIO(), interval_s=60.0)
    for done in range(0, 10_000_001, 1_000_000):
        bar.update(done)
    bar.finish()
    bar.finish()   # once only
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2   # the first update; reaching the total ends it (once)
    assert lines[0].startswith("progress: splitting m   0.0% (0/10 MB")
    assert lines[-1].endswith(" done") and "100.0%" in lines[-1]
    assert not any("\r" in line for line in lines)


def test_terminal_gets_a_bar_redrawn_in_place():
    out = FakeTTY()
    bar = Progress("downloading m", 4_000_000, stream=out, interval_s=0.0)
    bar.update(1_000_000)
    bar.finish()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n")
    assert "downloading m [######..................] 25.0%" in text
    assert "[########################] 100.0%" in text


def test_bar_line_parses_a_logged_line():
    assert bar_line("fetching shard ab 50.0% (1/2 MB, 1.0 MB/s, 1 s)") == \
        "fetching shard ab [############............] 50.0% (1/2 MB, 1.0 MB/s, 1 s)"
    assert bar_line("converting x (12 s so far)") == "converting x (12 s so far)"


def test_ticker_reports_a_silent_step(caplog):
    caplog.set_level(logging.INFO, "flowedge.progress")
    with Ticker("converting m: reading the GGUF", interval_s=0.05):
        time.sleep(0.18)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("(started)") and lines[-1].endswith("done")
    assert any("so far" in line for line in lines[1:-1])


def test_tail_shows_only_new_whole_progress_lines(tmp_path):
    head = tmp_path / "head.log"
    head.write_text("2026 INFO old run progress: x 10.0% (old)\n")
    seen: list[tuple[str, str]] = []
    tail = ProgressTail([head, tmp_path / "stage-1.log"], lambda node, line: seen.append((node, line)))
    with open(head, "a") as f:
        f.write("2026 INFO flowedge.progress: progress: converting m  5.0% (1/20 MB)\n")
        f.write("2026 INFO flowedge.daemon: something else\n")
        f.write("2026 INFO flowedge.progress: progress: converting m 50.0% (10/")   # not yet a whole line
    tail.poll()
    assert seen == [("head", "converting m  5.0% (1/20 MB)")]
    with open(head, "a") as f:
        f.write("20 MB)\n")
    (tmp_path / "stage-1.log").write_text("progress: fetching shard ab 100.0% (2/2 MB) done\n")
    tail.poll()
    assert seen[1:] == [("head", "converting m 50.0% (10/20 MB)"),
                        ("stage-1", "fetching shard ab 100.0% (2/2 MB) done")]


def test_terminal_progress_plain_lines_when_piped():
    out = io.StringIO()
    shown = TerminalProgress(out)
    shown("head", "converting m 50.0% (10/20 MB)")
    shown.note("  waiting for the head (loading models)")
    assert out.getvalue() == "  head: converting m 50.0% (10/20 MB)\n  waiting for the head (loading models)\n"
    tty = FakeTTY()
    shown = TerminalProgress(tty)
    shown("head", "converting m 50.0% (10/20 MB)")
    shown.note("  1/2 stages ready")
    assert tty.getvalue().startswith("\r\033[K  head: converting m [")
    assert tty.getvalue().endswith("\n  1/2 stages ready\n")
