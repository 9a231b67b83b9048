"""Progress of the long first-start steps (download, conversion, split, shard fetch) for an operator.

On a terminal a `Progress` redraws one bar in place; anywhere else (a daemon whose stderr is a log
file, journald) it logs a plain `progress:` line at most every `interval_s` seconds, plus one when
the task ends, and never writes a carriage return. `flowedge up` reads those lines from the head's
and stages' logs while it waits (`ProgressTail`) and shows them in its own terminal.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

log = logging.getLogger("flowedge.progress")

LOG_INTERVAL_S = 3.0
TTY_INTERVAL_S = 0.2
_BAR_WIDTH = 24
MARKER = "progress: "
_LINE_RE = re.compile(r"progress: (?P<what>.+?)\s+(?P<pct>\d+\.\d)% (?P<rest>.*)$")


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Reports `done` out of `total` units of one task; `update` is cheap to call per chunk."""

    def __init__(self, what: str, total: float, *, unit: str = "MB", scale: float = 1e6,
                 stream: TextIO | None = None, interval_s: float | None = None) -> None:
        self.what, self.total, self.unit, self.scale = what, max(float(total), 0.0), unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream)
        self.interval_s = interval_s if interval_s is not None else (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S)
        self.t0 = time.monotonic()
        self._last_s: float | None = None
        self.done = 0.0
        self.finished = False

    def update(self, done: float) -> None:
        self.done = done
        if done >= self.total:
            self.finish()
            return
        now = time.monotonic()
        if self._last_s is not None and now - self._last_s < self.interval_s:
            return
        self._last_s = now
        self._emit(final=False)

    def advance(self, amount: float) -> None:
        self.update(self.done + amount)

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.done = max(self.done, self.total)
            self._emit(final=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.done / self.scale / elapsed if elapsed > 0 else 0.0
        text = (f"{self.what} {pct:5.1f}% ({self.done / self.scale:.0f}/{self.total / self.scale:.0f} "
                f"{self.unit}, {rate:.1f} {self.unit}/s, {elapsed:.0f} s")
        if 0 < self.done < self.total and rate > 0:
            text += f", ~{(self.total - self.done) / self.scale / rate:.0f} s left"
        return text + ")"

    def _emit(self, final: bool) -> None:
        if self.tty:
            self.stream.write("\r" + bar_line(self.line()) + ("\n" if final else ""))
            self.stream.flush()
        else:
            log.info("%s%s%s", MARKER, self.line(), " done" if final else "")


def bar_line(line: str) -> str:
    """'what 42.0% (rest)' -> 'what [#########.........] 42.0% (rest)'."""
    m = _LINE_RE.match(MARKER + line)
    if m is None:
        return line
    filled = int(_BAR_WIDTH * min(float(m["pct"]), 100.0) / 100)
    return f"{m['what']} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {m['pct']}% {m['rest']}"


class Ticker:
    """For a step that reports nothing itself (reading a GGUF's metadata): a `progress:`-style line
    with the elapsed time every `interval_s`, from a background thread, until the block ends."""

    def __init__(self, what: str, interval_s: float = 5.0) -> None:
        self.what, self.interval_s = what, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-ticker", daemon=True)

    def __enter__(self) -> Ticker:
        self.t0 = time.monotonic()
        log.info("%s%s (started)", MARKER, self.what)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        log.info("%s%s (%.0f s) done", MARKER, self.what, time.monotonic() - self.t0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            log.info("%s%s (%.0f s so far)", MARKER, self.what, time.monotonic() - self.t0)


class ProgressTail:
    """Follows log files for `progress:` lines (what `flowedge up` shows while its nodes start)."""

    def __init__(self, paths: list[Path], show: Callable[[str, str], None]) -> None:
        self.paths, self.show = paths, show
        self._offsets = {p: (p.stat().st_size if p.is_file() else 0) for p in paths}

    def poll(self) -> None:
        for path in self.paths:
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[path])
                    data = f.read()
            except FileNotFoundError:
                continue
            cut = data.rfind(b"\n") + 1          # only whole lines; the rest is read next time
            self._offsets[path] += cut
            for raw in data[:cut].decode("utf-8", "replace").splitlines():
                at = 0 if raw.startswith(MARKER) else raw.find(" " + MARKER) + 1   # not "flowedge.progress:"
                if at > 0 or raw.startswith(MARKER):
                    self.show(path.stem, raw[at + len(MARKER):].strip())


class TerminalProgress:
    """Shows tailed progress lines: redrawn in place as a bar on a terminal, plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream)
        self._open = False

    def __call__(self, node: str, line: str) -> None:
        text = f"  {node}: {bar_line(line) if self.tty else line}"
        if self.tty:
            ends = line.endswith("done") or "(started)" in line
            self.stream.write("\r\033[K" + text + ("\n" if ends else ""))
            self._open = not ends
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, line: str) -> None:
        """A plain status line (e.g. 'waiting for the head'), ending any open bar first."""
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(line + "\n")
        self.stream.flush()
