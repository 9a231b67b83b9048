"""Re-planning around a board lost for good: when a stage slot stays empty to near the end of
`recovery_s`, the head splits the model over the stages that are left, if they can hold it, so that the
requests waiting for the lost board are answered instead of failed.

The rule, in order, each loop turn (`tick`), only once the cluster has been whole:
- a slot empty for `recovery_s - LEAD_S` (at least half of `recovery_s`): the survivors' Hellos (device
  profile, free memory) go to the planner's memory model (flowedge/plan/, `node.partition_plan.plan_inputs`);
- they fit: the requests waiting get REPLAN_BUDGET_S more; the survivors' split (`plan.resplit`, written
  in the background from the loss on) replaces the plan, the slots close up (stage 3 of 3 becomes stage 2
  of 2), each survivor is assigned its new layer range and fetches the shards it lacks from the head,
  checksummed (`shard_fetch`), and the paused requests replay once every one is ready (the scheduler's
  replay: token-identical at T=0);
- they do not fit: every waiting request fails now, told how many GiB are missing, and so does every
  request arriving while the slot stays empty (fail fast, rather than each waiting out `recovery_s`).

A board that comes back after the re-plan is a spare: its HELLO is refused with a reason, it asks again
(the node's own backoff), and it takes the next slot that empties; while a spare is known, a re-plan
(and the requests waiting) waits SPARE_WAIT_S longer for it. The plan does not grow back under load:
restart the head to spread the model over every board again (docs/operations.md, "A board lost for
good", says why).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from flowedge.errors import ClusterNotReady
from flowedge.models.split import layer_counts
from flowedge.node.partition_plan import Plan, plan_inputs, resplit
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)

LEAD_S = 2.0        # the re-plan starts this long before a lost slot's recovery_s runs out
REPLAN_BUDGET_S = 120.0   # at least this long for each of the re-plan's split and the survivors' reload
SPARE_WAIT_S = 35.0   # a spare asks to join at least this often (node_base.HELLO_MAX_WAIT_S + margin)
MAX_EVENTS = 20     # membership events kept for status and the dashboard
FULL = "the plan is full"   # Membership.admit's refusal of a stage when every slot is held


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """Something that changed who serves the model, for `status` and the dashboard."""
    at_unix: float
    kind: str      # lost | replanning | replanned | no_fit | spare | back
    text: str

    def row(self) -> dict:
        return {"at_unix": round(self.at_unix, 3), "kind": self.kind, "text": self.text}


def survivor_counts(config, base_config, hellos: list) -> list[int] | str:
    """Layer counts for the surviving stages (in slot order), or why they cannot hold the model (the
    planner's message, which names the GiB missing). A device with no shipped profile is split by layer
    count: its memory cannot be judged, and the load will say if it runs short."""
    from flowedge.errors import PlanError
    from flowedge.plan.partition import plan_partition

    n_layers = int(base_config.num_hidden_layers)
    if not hellos:
        return "no stage is left to hold the model"
    inputs = plan_inputs(replace(config, stages=len(hellos), layers=[]), base_config, hellos)
    if inputs is None:
        return layer_counts(n_layers, len(hellos), None) if len(hellos) <= n_layers else \
            f"{n_layers} layers cannot be split over {len(hellos)} stages"
    try:
        return plan_partition(inputs).counts
    except PlanError as err:
        return str(err)


class Shrinker:
    """Watches the plan's slots and re-plans onto the survivors of a lost stage (see the module doc)."""

    def __init__(self, config, members, engines, requests, home: Path, split: Callable[..., Plan] = resplit,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config, self.members, self.engines, self.requests = config, members, engines, requests
        self.home, self.split, self.clock, self.wall = home, split, clock, wall
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shrink")
        self.events: deque[MembershipEvent] = deque(maxlen=MAX_EVENTS)
        self.holders: list[str] = []        # node ids by slot, as last seen whole
        self.whole_once = False
        self.lost_at: float | None = None   # when a slot emptied (None: every slot held)
        self.no_fit = ""                    # why the survivors cannot hold the model (failing fast meanwhile)
        self.pending: Future | None = None  # the survivors' split being written (from the loss on)
        self.pending_counts: list[int] | None = None   # ... with these layer counts
        self.started_s: float | None = None   # when the re-plan under way was decided
        self.lost_now: list[str] = []       # the boards the re-plan under way is around
        self.lost_names: list[str] = []     # the boards the plan was shrunk around
        self.spares: dict[str, float] = {}  # node id -> when it last asked to join (unix)
        self.last_replan_s: float | None = None

    # ---- hooks ------------------------------------------------------------------------------------
    def admit(self, hello: proto.Hello) -> str | None:
        """Membership's admission; a stage refused only because a re-plan closed the slots is a spare."""
        why = self.members.admit(hello)
        if why is None or not why.startswith(FULL) or not self.lost_names or hello.role != "stage":
            return why
        if hello.node_id not in self.spares:
            self._event("spare", f"{hello.node_id} came back: it waits as a spare and takes the next slot "
                                 "that empties")
        self.spares[hello.node_id] = self.wall()
        return (f"the model was re-planned onto {len(self.members.slots)} stages after "
                f"{', '.join(self.lost_names)} was lost; {hello.node_id} waits as a spare and joins when a slot "
                "empties (restart the head to spread the model over every board again)")

    def tick(self) -> None:
        """One look at the slots (the head's loop, between engine turns)."""
        if not self.config.replan_on_loss or self.members.plan is None:
            return
        now, m = self.clock(), self.members
        if m.cluster_ready():
            self._whole(now)
        if None not in m.slots:
            self._filled()
            return
        if not self.whole_once or all(i is None for i in m.slots):   # no stage left: nothing to re-plan onto
            return
        if self.lost_at is None:
            self._lost(now)
        assert self.lost_at is not None   # set by _lost
        if self.no_fit:
            self.requests.fail_waiting(self.no_fit)
        elif self.started_s is None and now >= self.lost_at + self.wait_s() + self._spare_grace():
            self._decide(now)
        elif self.started_s is not None and self.pending is not None and self.pending.done():
            self._apply(now)

    def wait_s(self) -> float:
        """How long a slot stays empty before the re-plan: LEAD_S short of recovery_s, at least half of it."""
        return max(self.config.recovery_s - LEAD_S, self.config.recovery_s / 2)

    def budget_s(self) -> float:
        """How long the requests waiting may wait for the re-plan's split, and again for the survivors'
        reload (28 int4 layers of the 1.5B load in ~30 s on a busy 2-core box)."""
        return max(self.config.recovery_s, REPLAN_BUDGET_S)

    def _spare_grace(self) -> float:
        """A spare asked to join lately: it takes the empty slot on its next try (no re-plan at all), so the
        re-plan waits its backoff out, and so do the requests waiting. Spares silent for long are forgotten."""
        wall = self.wall()
        self.spares = {name: t for name, t in self.spares.items() if wall - t <= 2 * SPARE_WAIT_S}
        if not self.spares:
            return 0.0
        self.requests.extend_deadlines(self.lost_at + self.config.recovery_s + SPARE_WAIT_S)
        return SPARE_WAIT_S

    def status(self) -> dict:
        return {"replan_on_loss": self.config.replan_on_loss, "events": [e.row() for e in self.events],
                "spares": sorted(self.spares), "replanning": self.started_s is not None,
                "last_replan_s": self.last_replan_s, "no_fit": self.no_fit}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- steps ------------------------------------------------------------------------------------
    def _whole(self, now: float) -> None:
        self.whole_once = True
        self.holders = [self.members.peers[i].name for i in self.members.slots]
        for name in [n for n in self.holders if n in self.spares]:
            self.spares.pop(name)
            self._event("back", f"{name} holds a slot again")
        if self.started_s is not None and self.pending is None:
            self.last_replan_s = round(now - self.started_s, 3)
            n = len(self.holders)
            self._event("replanned", f"serving on {n} stage{'s' if n > 1 else ''}, layers "
                                     f"{[list(r) for r in self.members.plan.ranges]}; the re-plan took "
                                     f"{self.last_replan_s:.1f} s")
            self.started_s = None

    def _filled(self) -> None:
        """Every slot is held: a board came back in time (before the re-plan, or during it: dropped)."""
        if self.started_s is not None and self.pending is not None:
            self._event("back", "a board joined the empty slot during the re-plan: the plan stays as it was")
            self.started_s = None
        if self.started_s is None:
            self.pending = self.pending_counts = None
        self.lost_at, self.no_fit = None, ""

    def _lost(self, now: float) -> None:
        self.lost_at = now
        empty = [k for k, i in enumerate(self.members.slots, 1) if i is None]
        names = [self.holders[k - 1] if k <= len(self.holders) else f"stage {k}" for k in empty]
        self._event("lost", f"{', '.join(names)} left (stage {', '.join(map(str, empty))}); the model is "
                            f"re-planned onto the other stages if it stays away {self.wait_s():g} s")
        self._prepare()

    def _prepare(self) -> list[int] | str:
        """The survivors' layer counts (or why they cannot hold the model); their split is written in the
        background from the loss on (it took 13 s for the real pair), so it is ready when the re-plan is decided.
        Unused if the board comes back; a later re-plan to the same counts reuses it from disk."""
        m = self.members
        survivors = [m.peers[i] for i in m.slots if i is not None]
        counts = survivor_counts(m.config, m.plan.base_config, [p.hello for p in survivors])
        if not isinstance(counts, str) and counts != self.pending_counts:
            config = replace(m.config, stages=len(survivors), layers=[])
            self.pending, self.pending_counts = self.pool.submit(self.split, m.plan, counts, config, self.home), counts
        return counts

    def _decide(self, now: float) -> None:
        m = self.members
        survivors = [m.peers[i] for i in m.slots if i is not None]
        counts = self._prepare()
        lost = [self.holders[k] if k < len(self.holders) else f"stage {k + 1}"
                for k, i in enumerate(m.slots) if i is None]
        if isinstance(counts, str):
            empty = [k for k, i in enumerate(m.slots, 1) if i is None]
            named = ", ".join(f"{name} (stage {k})" for name, k in zip(lost, empty))
            self.no_fit = (f"{ClusterNotReady.PREFIX}{named} was lost and the {len(survivors)} "
                           f"stages left cannot hold the model: {counts}")
            self._event("no_fit", self.no_fit[len(ClusterNotReady.PREFIX):])
            log.error("%s", self.no_fit)
            self.requests.fail_waiting(self.no_fit)
            return
        self.started_s, self.lost_now = now, lost
        self.requests.extend_deadlines(now + self.budget_s())
        assert self.lost_at is not None   # a re-plan is decided only after a loss
        self._event("replanning", f"{', '.join(lost)} stayed away {now - self.lost_at:.1f} s: re-planning "
                                  f"onto {', '.join(p.name for p in survivors)} with layers {counts}")
        log.warning("%s", self.events[-1].text)

    def _apply(self, now: float) -> None:
        """The survivors' split is written: close up the slots and assign the new layer ranges."""
        future, self.pending, self.pending_counts = self.pending, None, None
        m = self.members
        survivors = [i for i in m.slots if i is not None]
        assert future is not None   # called once the pending split is done
        try:
            plan = future.result()
        except Exception as err:  # noqa: BLE001 - a failed split must fail the waiting requests, not the head
            self.no_fit = f"{ClusterNotReady.PREFIX}re-planning onto the stages left failed: {err}"
            self._event("no_fit", self.no_fit[len(ClusterNotReady.PREFIX):])
            self.started_s = None
            return
        if len(plan.ranges) != len(survivors):   # another stage left meanwhile: decide again
            self.started_s = None
            return
        config = replace(m.config, stages=len(survivors), layers=[])
        m.config = self.engines.config = config
        m.slots = survivors
        for k, identity in enumerate(survivors, start=1):
            m.peers[identity].stage = k
        m.sent_assign.clear()
        m.plan = plan
        self.lost_names = self.lost_now
        self.requests.extend_deadlines(now + self.budget_s())   # the survivors' reload
        log.warning("re-planned onto %d stage(s): layers %s (%s)", len(survivors), [list(r) for r in plan.ranges],
                    plan.split_dir)
        m.assign_all()

    def _event(self, kind: str, text: str) -> None:
        self.events.append(MembershipEvent(self.wall(), kind, text))
        log.info("membership: %s", text)
