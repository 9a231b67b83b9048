"""Progress of the long first-start steps (download, conversion, split, shard fetch) for an operator.

tqdm draws and formats: on a terminal a `Progress` is a tqdm bar redrawn in place; anywhere else (a
daemon whose stderr is a log file, journald), or with TQDM_DISABLE set, it logs tqdm's meter as a
plain `progress:` line at most every `interval_s` seconds, plus one ending in "done", and never
writes a carriage return. `flowedge up` follows those lines in its nodes' logs (`ProgressTail`) and
shows them in its own terminal (`NodeProgress`): the line is shown as logged, so nothing parses it.
tqdm is imported lazily: the client install has no tqdm, and only node-side code reports progress.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("flowedge.progress")

LOG_INTERVAL_S = 3.0
TTY_INTERVAL_S = 0.2
METER_COLUMNS = 72     # the logged meter's width, bar included
MARKER = "progress: "


def _tqdm() -> Any:
    from tqdm import tqdm
    return tqdm


def bars_wanted(stream: TextIO) -> bool:
    """A redrawn bar only on a terminal, and not when TQDM_DISABLE asks for none (tqdm's own switch)."""
    if os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Reports `done` out of `total` units of one task; `update` is cheap to call per chunk.
    `unit="B"` counts bytes (shown scaled: 12.3MB); any other unit is shown as counted."""

    def __init__(self, what: str, total: float, *, unit: str = "B",
                 stream: TextIO | None = None, interval_s: float | None = None) -> None:
        self.what, self.total, self.unit = what, max(float(total), 0.0), unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bars_wanted(self.stream)
        self.interval_s = interval_s if interval_s is not None else (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S)
        self.t0 = time.monotonic()
        self._last_s: float | None = None
        self.done = 0.0
        self.finished = False
        self._bar = (_tqdm()(total=self.total, desc=what, unit=unit, unit_scale=unit == "B", file=self.stream,
                             mininterval=self.interval_s, dynamic_ncols=True, leave=True)
                     if self.tty else None)

    def update(self, done: float) -> None:
        if self._bar is not None:
            self._bar.update(min(done, self.total) - self._bar.n)
        self.done = done
        if done >= self.total:
            self.finish()
            return
        if self._bar is None:
            now = time.monotonic()
            if self._last_s is None or now - self._last_s >= self.interval_s:
                self._last_s = now
                log.info("%s%s", MARKER, self.line())

    def advance(self, amount: float) -> None:
        self.update(self.done + amount)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.done = max(self.done, self.total)
        if self._bar is not None:
            self._bar.update(self.total - self._bar.n)
            self._bar.close()
        else:
            log.info("%s%s done", MARKER, self.line())

    def line(self) -> str:
        """tqdm's meter for the task so far, with an ASCII bar of fixed width (fit for a log file)."""
        n, total = _whole(min(self.done, self.total)), _whole(self.total)
        return _tqdm().format_meter(n, total, time.monotonic() - self.t0,
                                    ncols=METER_COLUMNS, prefix=self.what, ascii=True, unit=self.unit,
                                    unit_scale=self.unit == "B")


def _whole(x: float) -> float:
    """10.0 -> 10, so a count reads "5/10 steps", not "5/10.0"."""
    return int(x) if float(x).is_integer() else x


class Ticker:
    """For a step that reports nothing itself (reading a GGUF's metadata): a `progress:` line with
    the elapsed time every `interval_s`, from a background thread, until the block ends."""

    def __init__(self, what: str, interval_s: float = 5.0) -> None:
        self.what, self.interval_s = what, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-ticker", daemon=True)

    def __enter__(self) -> Ticker:
        self.t0 = time.monotonic()
        log.info("%s%s (started)", MARKER, self.what)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        log.info("%s%s (%s) done", MARKER, self.what, self._elapsed())

    def _elapsed(self) -> str:
        return _tqdm().format_interval(time.monotonic() - self.t0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            log.info("%s%s (%s so far)", MARKER, self.what, self._elapsed())


class ProgressTail:
    """Follows log files for `progress:` lines (what `flowedge up` shows while its nodes start).
    Only whole lines are read; a line is passed on from its marker to its end, unparsed."""

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


class NodeProgress:
    """Shows tailed progress lines. On a terminal: one tqdm status line redrawn in place with the
    latest line, and finished steps and notes written above it (`tqdm.write`); plain lines otherwise."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._status = (_tqdm()(total=0, bar_format="{desc}", file=self.stream, leave=False, dynamic_ncols=True)
                        if bars_wanted(self.stream) else None)

    def __call__(self, node: str, line: str) -> None:
        text = f"  {node}: {line}"
        if self._status is None:
            self._write(text)
        elif line.endswith("done") or line.endswith("(started)"):
            self._status.set_description_str("", refresh=False)
            self._write(text)
        else:
            self._status.set_description_str(text)

    def note(self, line: str) -> None:
        """A plain status line (e.g. 'waiting for the head'), written above any bar."""
        self._write(line)

    def close(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None

    def _write(self, text: str) -> None:
        if self._status is None:
            self.stream.write(text + "\n")
            self.stream.flush()
        else:
            _tqdm().write(text, file=self.stream)
