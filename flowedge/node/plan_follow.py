"""A standby head keeps the head's plan: when the head re-plans around a board lost for good (node/shrink.py),
its stages hold the survivors' layer ranges, and a standby that took over with the plan it loaded at start
would find no slot that matches them (a stage 2 of 2 where it expects 3). The head's state (HeadState)
carries the plan's layer counts; the standby writes the same split in the background as soon as they
change, and adopts it when it takes over, so the stages rejoin their slots without a reload.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

from flowedge.node.partition_plan import Plan, resplit

log = logging.getLogger(__name__)

ADOPT_WAIT_S = 120.0   # a split still being written at the takeover is waited for this long (the real pair: 13 s)


class PlanFollower:
    """The head's layer counts as its HeadState says, split ahead of need; `adopt` puts them in place."""

    def __init__(self, members, engines, home: Path, split=resplit) -> None:
        """`members` and `engines`: the head's Membership and HeadEngines, whose plan and config it swaps."""
        self.members, self.engines, self.home, self.split = members, engines, home, split
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="standby-split")
        self.pending: Future[Plan] | None = None
        self.pending_counts: list[int] = []

    def seen(self, counts: list[int]) -> None:
        """The head's plan has these layer counts; begin their split if the standby does not hold it yet."""
        plan = self.members.plan
        if not counts or plan is None or counts == self.pending_counts:
            return
        if counts == plan.counts:   # the plan loaded at start (again)
            self.pending, self.pending_counts = None, []
            return
        if sum(counts) != sum(plan.counts):
            log.warning("standby: the head's plan has %d layers (%s), this standby's model %d: not followed",
                        sum(counts), counts, sum(plan.counts))
            return
        log.info("standby: the head re-planned to layers %s; writing that split too", counts)
        self.pending_counts = list(counts)
        self.pending = self.pool.submit(self.split, plan, list(counts), self._config(len(counts)), self.home)

    def adopt(self, wait_s: float = ADOPT_WAIT_S) -> None:
        """At the takeover: the head's last plan becomes this head's (waiting for its split if needed)."""
        future, self.pending, self.pending_counts = self.pending, None, []
        self.pool.shutdown(wait=False)
        if future is None:
            return
        t0 = time.monotonic()
        try:
            plan = future.result(timeout=wait_s)
        except FutureTimeout:
            log.error("standby: the head's re-planned split was not written within %g s; serving the plan "
                      "loaded at start (stages that hold other layers will reload)", wait_s)
            return
        except Exception as err:  # noqa: BLE001 - the standby still takes over, with the plan it has
            log.error("standby: the head's re-planned split failed (%s); serving the plan loaded at start", err)
            return
        config = self._config(len(plan.ranges))
        m = self.members
        m.config = self.engines.config = config
        m.slots = [None] * len(plan.ranges)
        m.plan = plan
        log.warning("standby: serving the head's re-planned split: layers %s (waited %.1f s)", plan.counts,
                    time.monotonic() - t0)

    def _config(self, stages: int):
        return replace(self.members.config, stages=stages, layers=[])
