"""The fault half of tools/soak.py: a schedule of faults, each a small class with one `apply`, so a new
fault (a standby head's failover, a network split) is one more class and one more entry in `schedule()`.

A fault that needs what the cluster lacks refuses before the soak starts (`check`), with a message that
says what is missing, instead of soaking something that cannot be what was asked for.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field

from flowedge.errors import ConfigError

log = logging.getLogger("soak")


class Fault:
    """One kind of fault: `first_s` after the start, then every `every_s` (0: only once)."""
    name = "fault"
    first_s: float = 0.0
    every_s: float = 0.0

    def check(self, standby: bool) -> None:
        """Raise ConfigError when the cluster (with a standby head or not) cannot take this fault."""

    def apply(self, procs, rng: random.Random) -> str:
        """Do it; returns what was done, for the log and the counts."""
        raise NotImplementedError

    def possible(self, procs) -> bool:
        """Whether there is still something to hurt (else this fault is done for the soak)."""
        return bool(live_stages(procs))


def live_stages(procs) -> list[int]:
    """Stage slots that may still be hurt: not lost for good."""
    return [k for k in range(1, len(procs.cluster.procs)) if k not in procs.lost]


@dataclass
class StageKill(Fault):
    """kill -9 a random stage; restarted `gap_s` later, or never when `restart` is off."""
    every_s: float = 600.0
    restart: bool = True
    gap_s: float = 2.0
    first_s: float = 0.0
    name: str = "stage-kill"

    def __post_init__(self) -> None:
        self.first_s = self.first_s or self.every_s

    def apply(self, procs, rng: random.Random) -> str:
        k = rng.choice(live_stages(procs))
        if self.restart:
            procs.kill_restart(k, self.gap_s)
            return f"stage {k} killed, restarted {self.gap_s:g} s later"
        procs.kill_for_good(k)
        return f"stage {k} killed, not restarted"


@dataclass
class StageChaos(Fault):
    """The old quick chaos: a random stage kill -9'ed and restarted, or SIGSTOPped for a while."""
    every_s: float = 20.0
    gap_s: float = 2.0
    stop_for_s: float = 3.0
    first_s: float = 0.0
    name: str = "chaos"

    def __post_init__(self) -> None:
        self.first_s = self.first_s or self.every_s

    def apply(self, procs, rng: random.Random) -> str:
        k = rng.choice(live_stages(procs))
        if rng.choice(("kill", "stop")) == "kill":
            procs.kill_restart(k, self.gap_s)
            return f"stage {k} killed and restarted"
        procs.stop_cont(k, self.stop_for_s)
        return f"stage {k} stopped for {self.stop_for_s:g} s"


@dataclass
class BoardLost(Fault):
    """Once, at `first_s`: a stage killed and never restarted (a board that never comes back). Only a
    cluster that re-plans onto the survivors keeps answering after it; without that, every request
    fails after the head's recovery deadline, with a clear error."""
    first_s: float = 600.0
    name: str = "board-lost"

    def apply(self, procs, rng: random.Random) -> str:
        k = max(live_stages(procs))
        procs.kill_for_good(k)
        return f"stage {k} lost for good"


@dataclass
class HeadKill(Fault):
    """kill -9 the head every `every_s`; only where a standby head is there to take over. The killed head
    comes back as the new standby (tools/soak_standby.py), unless the soak says not: then one kill only."""
    every_s: float = 1800.0
    first_s: float = 0.0
    name: str = "head-kill"

    def __post_init__(self) -> None:
        self.first_s = self.first_s or self.every_s

    def check(self, standby: bool) -> None:
        if not standby:
            raise ConfigError("a head kill needs a standby head to take over, and this cluster has none; "
                              "drop --head-kill-every or add --standby")

    def apply(self, procs, rng: random.Random) -> str:
        return procs.kill_head()

    def possible(self, procs) -> bool:
        return procs.can_kill_head()


def schedule(args) -> list[Fault]:
    """The faults the command line asks for."""
    faults: list[Fault] = []
    if args.stage_kill_every > 0:
        faults.append(StageKill(every_s=args.stage_kill_every, restart=not args.no_restart, gap_s=args.gap))
    if args.chaos_every > 0:
        faults.append(StageChaos(every_s=args.chaos_every, gap_s=args.gap, stop_for_s=args.stop_for))
    if args.board_lost_at > 0:
        faults.append(BoardLost(first_s=args.board_lost_at))
    if args.head_kill_every > 0:
        faults.append(HeadKill(every_s=args.head_kill_every))
    return faults


@dataclass
class Schedule:
    """Runs the faults at their times, one at a time, and counts them by name."""
    faults: list[Fault]
    seed: int = 0
    counts: dict = field(default_factory=dict)
    done: list = field(default_factory=list)   # (s since start, what)

    def check(self, standby: bool) -> None:
        for f in self.faults:
            f.check(standby)

    def run(self, procs, readiness, stop: threading.Event) -> None:
        rng, t0 = random.Random(self.seed), time.monotonic()
        due = {id(f): f.first_s for f in self.faults}
        while self.faults:
            f = min((f for f in self.faults if due[id(f)] is not None), key=lambda f: due[id(f)], default=None)
            if f is None or stop.wait(max(0.0, t0 + due[id(f)] - time.monotonic())):
                return
            if not f.possible(procs):
                due[id(f)] = None
                continue
            readiness.hurt()
            what = f.apply(procs, rng)
            readiness.hurt()
            log.info("fault: %s", what)
            self.counts[f.name] = self.counts.get(f.name, 0) + 1
            self.done.append((round(time.monotonic() - t0, 1), what))
            due[id(f)] = due[id(f)] + f.every_s if f.every_s > 0 else None
