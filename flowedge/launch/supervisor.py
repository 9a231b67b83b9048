"""`flowedge up`'s supervisor: a stage (or drafter) process of the local cluster that dies is started
again with its first command line (same node id, so it takes its slot back), after a delay that doubles
with each death in a row (1, 2, 4 ... 30 s) and is forgotten once the process has stayed up a minute.
Each death and restart is said (the terminal of `up`, or the supervisor's log for `up --detach`). The
head is not restarted: its death ends `up` (a detached supervisor stops watching and says so).

A detached cluster's nodes are not this process's children (the `up --detach` that started them has
exited), so `RecordedCluster` watches them by pid from `cluster.json` and starts the replacements itself.
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

from flowedge.launch.local_cluster import STATE_FILE

log = logging.getLogger(__name__)

POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class Backoff:
    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0    # up this long: its earlier deaths are forgotten

    def delay_s(self, deaths_in_a_row: int) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, deaths_in_a_row - 1))


class Supervised(Protocol):
    """What the supervisor watches: node 0 is the head; `restart(k)` starts node k again."""
    procs: list

    @property
    def names(self) -> list[str]: ...

    @property
    def run_dir(self) -> Path: ...

    def restart(self, k: int, detach: bool = False): ...


@dataclass
class Watch:
    """One node's deaths in a row, when its restart is due, and when it last started."""
    started_s: float
    deaths: int = 0
    restarts: int = 0
    due_s: float | None = None


class Supervisor:
    def __init__(self, cluster: Supervised, say: Callable[[str], None], backoff: Backoff = Backoff(),
                 clock: Callable[[], float] = time.monotonic, detach: bool = False) -> None:
        self.cluster, self.say, self.backoff, self.clock, self.detach = cluster, say, backoff, clock, detach
        self.watches = {k: Watch(started_s=clock()) for k in range(1, len(cluster.procs))}

    def head_exited(self) -> bool:
        return self.cluster.procs[0].poll() is not None

    def tick(self) -> None:
        """Notice the nodes that died, and start those whose delay has passed."""
        now = self.clock()
        for k, watch in self.watches.items():
            proc = self.cluster.procs[k]
            if proc.poll() is None:
                if watch.deaths and now - watch.started_s >= self.backoff.stable_s:
                    watch.deaths = 0
            elif watch.due_s is None:
                self._noticed(k, watch, proc, now)
            elif now >= watch.due_s:
                self._restart(k, watch, now)

    def _noticed(self, k: int, watch: Watch, proc, now: float) -> None:
        watch.deaths += 1
        delay = self.backoff.delay_s(watch.deaths)
        watch.due_s = now + delay
        name = self.cluster.names[k]
        self.say(f"{name} {exit_text(proc.poll())}; restarting it in {delay:g} s "
                 f"({'death' if watch.deaths == 1 else 'deaths'} in a row: {watch.deaths}; log "
                 f"{self.cluster.run_dir / (name + '.log')})")

    def _restart(self, k: int, watch: Watch, now: float) -> None:
        try:
            proc = self.cluster.restart(k, self.detach)
        except OSError as err:
            watch.due_s = None   # counted as one more death: the next try waits longer
            self.say(f"{self.cluster.names[k]} could not be started again: {err}")
            return
        watch.due_s, watch.started_s = None, now
        watch.restarts += 1
        self.say(f"{self.cluster.names[k]} restarted (pid {proc.pid}; restart {watch.restarts})")


def exit_text(code) -> str:
    """How a node ended, from its exit code (None or a non-int: a process that was not our child)."""
    if not isinstance(code, int):
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# ---- a detached cluster ------------------------------------------------------------------------
class ForeignProcess:
    """A node process another process started: running while its pid is, with the same start time, and
    not a zombie. Its exit status cannot be known (`poll` gives "exited" once it is gone)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.created = psutil.Process(pid).create_time()
        except psutil.Error:
            self.created = None

    def poll(self) -> str | None:
        if self.created is None:
            return "exited"
        try:
            p = psutil.Process(self.pid)
            if p.create_time() == self.created and p.status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            pass
        self.created = None
        return "exited"


@dataclass
class RecordedCluster:
    """A detached local cluster as `cluster.json` records it: its nodes' pids, names and command lines."""
    run_dir: Path
    state: dict
    procs: list = field(default_factory=list)

    @classmethod
    def load(cls, run_dir: Path) -> "RecordedCluster":
        state = json.loads((run_dir / STATE_FILE).read_text())
        return cls(run_dir, state, [ForeignProcess(pid) for pid in state["pids"]])

    @property
    def names(self) -> list[str]:
        return self.state["names"]

    def restart(self, k: int, detach: bool = True) -> subprocess.Popen:
        with open(self.run_dir / f"{self.names[k]}.log", "ab") as logf:
            proc = subprocess.Popen(self.state["commands"][k], stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[k] = proc
        self.state["pids"][k] = proc.pid
        self._record(k, proc.pid)
        return proc

    def _record(self, k: int, pid: int) -> None:
        """Node k's new pid into the state file as it is now (`up` may have added this supervisor's own pid
        after it was read), atomically: `flowedge down` may read it at any time."""
        state = json.loads((self.run_dir / STATE_FILE).read_text())
        state["pids"][k] = pid
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state) + "\n")
        tmp.replace(self.run_dir / STATE_FILE)


def watch_detached(run_dir: Path, stop: threading.Event, backoff: Backoff = Backoff()) -> None:
    """The detached supervisor's life: restart dead stages until stopped (`flowedge down`) or the head exits."""
    cluster = RecordedCluster.load(run_dir)
    supervisor = Supervisor(cluster, log.warning, backoff, detach=True)
    log.info("supervising the local cluster of %s: %s", cluster.state.get("addr"), ", ".join(cluster.names))
    while not stop.wait(POLL_S):
        if supervisor.head_exited():
            log.error("the head exited; its stages are left as they are (`flowedge down` stops them)")
            return
        supervisor.tick()
