"""Pre-drafting: grow node 0's draft tree while its segments are in flight, so the expansion after the next
verification finds its nodes already drafted.

After an acceptance FlowSpec re-roots the stored draft tree at the new committed token and spends draft
calls growing it best-first (`Drafter.advance`). Those calls sit on the critical path: the next segment
cannot leave before them. The tree's log-scores are the draft's own probabilities of each path, so growing
it best-first *before* the verification spends the calls on the likeliest outcomes (accepted prefix +
bonus token) in proportion to how likely they are; re-rooting then keeps the subtree under the outcome
that happened. When that subtree already holds `min_fresh` nodes the round has not sent (a hit), the
expansion sends them at once, with no draft call; otherwise it drafts as before (a miss).

Where the calls run:
- `idle`: node 0 itself, one call at a time, only when the next segment is not due before the call
  would end (`GapClock`): a call, once started, delays whatever arrives during it.
- `drafter`: a drafter device with a replica of node 0's draft KV (engine/draft_sync.py). Node 0 sends it
  a snapshot of its tree at the committed context with the K/V rows the replica lacks; the drafter grows
  it by the job's calls and answers with the new nodes and the K/V rows of those it ran. Node 0 grafts
  the answer by token path whenever it arrives: nodes under the walk's new root are valid there however
  far the walk moved (a draft's output depends only on the token path), the rest are not found. The
  simulator runs the same `DrafterDevice` on the snapshot when the job leaves, and delivers the answer
  after the drafter's clock and link.

Lossless by construction: only the tree the proposals come from grows sooner; the base model verifies
every token as before.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowedge.core.merge import match_paths
from flowedge.core.tree import DraftTree
from flowedge.engine.draft_sync import DraftGrowth, DraftSnapshot, graft, roots_free, snapshot
from flowedge.engine.drafter import Drafter


_JOB_SEQ = itertools.count(1)   # job numbers unique in the process: a replayed request's jobs never reuse one
KEPT_SNAPSHOTS = 4              # jobs whose snapshot node 0 keeps to graft their answer (the newest)


@dataclass(frozen=True, slots=True, eq=False)
class PreDraftJob:
    """Grow the tree rooted at `context` (the committed context when the job was made) by `calls` calls."""
    seq: int
    context: tuple[int, ...]
    calls: int


@dataclass(frozen=True, slots=True)
class PreDraftStep:
    """Event: node 0 is idle; run one call of `job`."""
    job: PreDraftJob


@dataclass(frozen=True, slots=True)
class PreDrafted:
    """Event: the drafter device's answer to `job` reached node 0; `growth` None: no answer (no drafter,
    it was lost, or its replica was behind): node 0 drafts alone and ships the whole context next time."""
    job: PreDraftJob
    growth: DraftGrowth | None = None


@dataclass
class PreDraftStats:
    """What pre-drafting did for one answer (in its stats and in the head's status)."""
    jobs: int = 0
    calls: int = 0           # pre-draft calls, off node 0's critical path
    hits: int = 0            # expansions that sent pre-drafted nodes without a draft call
    misses: int = 0          # expansions after pre-drafting that still drafted on node 0
    critical_calls: int = 0  # node 0 draft calls on the critical path (round starts and expansions)
    skipped: int = 0         # idle calls not started: the next segment was due before one would end
    late: int = 0            # drafter answers that came after the walk moved on (grafted by token path)
    grafted: int = 0         # nodes the drafter's answers added to node 0's tree
    adopted: int = 0         # K/V rows of nodes the drafter ran that node 0 had not (calls node 0 saves)
    unanswered: int = 0      # jobs with no answer (no drafter, lost, replica behind)

    def as_dict(self) -> dict:
        looked = self.hits + self.misses
        return {"jobs": self.jobs, "calls": self.calls, "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / looked, 4) if looked else None,
                "critical_draft_calls": self.critical_calls, "skipped_idle_calls": self.skipped,
                "late_answers": self.late, "grafted_nodes": self.grafted, "adopted_rows": self.adopted,
                "unanswered": self.unanswered}


def fresh_nodes(base: DraftTree, tree: DraftTree, alive: torch.Tensor, cur: int) -> int:
    """Nodes of `base` (rooted at the walk's node `cur`) that the round's tree does not hold yet."""
    found, _ = match_paths(tree, alive, cur, base)
    return int((~found).sum())


class GapClock:
    """When the next segment is due back: each segment's send time plus the mean round trip so far, on the
    head's clock (virtual under simulation)."""

    def __init__(self) -> None:
        self.sent: dict[int, float] = {}
        self.mean_s: float | None = None

    def on_send(self, seq: int, now: float) -> None:
        self.sent[seq] = now

    def on_return(self, seq: int, now: float) -> None:
        t = self.sent.pop(seq, None)
        if t is not None:
            rtt = now - t
            self.mean_s = rtt if self.mean_s is None else 0.8 * self.mean_s + 0.2 * rtt

    def fits(self, now: float, call_s: float) -> bool:
        """Whether a call started now ends before the next segment is due."""
        if not self.sent:
            return True
        if self.mean_s is None:   # no round trip measured yet: the segment may be back any moment
            return False
        return min(self.sent.values()) + self.mean_s - now >= call_s


class PreDrafting:
    """Node 0's side: hands out jobs while segments are in flight, runs or merges their calls on node 0's
    draft tree, and tells the expansion whether it may skip its draft call (counting hits and misses)."""

    def __init__(self, drafter: Drafter, config, call_s: float | None = None,
                 present: Callable[[], bool] = lambda: True) -> None:
        """`config`: the SpecConfig (mode, calls per job, expansion width and lookup rows; an expansion
        skips its call with `l_max` unsent nodes, a segment's worth); `call_s`: one draft call on the
        head's clock (from the device profile; None: measured wall time, the head's clock on a daemon);
        `present`: whether a drafter device is there to take jobs (the daemon's head asks its membership);
        with none, no job is made: no snapshot copied for nobody."""
        self.drafter, self.config, self.call_s = drafter, config, call_s
        self.mode, self.calls, self.min_fresh = config.predraft, config.predraft_calls, config.l_max
        self.present = present
        self.reset()

    def reset(self) -> None:
        self.stats = PreDraftStats()
        self.gaps = GapClock()
        self.out: PreDraftJob | None = None   # one job at a time
        self.done = 0                         # calls of `out` done so far (idle)
        self.since_expansion = 0              # pre-draft calls since the last expansion
        self.measured_s = 0.0
        self.shipped: tuple[int, ...] = ()    # the context the drafter's replica holds the rows of
        self.snaps: OrderedDict[int, tuple[PreDraftJob, DraftSnapshot]] = OrderedDict()   # jobs sent

    # ---- jobs ---------------------------------------------------------------------------------------
    def new_round(self) -> None:
        self.gaps.sent.clear()
        self.out = None

    def plan(self, context: list[int], in_flight: bool) -> list:
        """A job for the tree at `context` while segments are in flight: one out at a time on a drafter;
        in node 0's gaps the newest replaces the last (the scheduler keeps one idle item per request, and
        drops them while several requests run)."""
        from flowedge.engine.events import WhenIdle

        if not in_flight or (self.out is not None and self.mode != "idle"):
            return []
        if self.mode == "drafter" and not self.present():
            return []
        self.stats.jobs += 1
        job = self.out = PreDraftJob(next(_JOB_SEQ), tuple(context), self.calls)
        self.done = 0
        if self.mode == "idle":
            return [WhenIdle(PreDraftStep(job))]
        return self._offload(job, context)

    def _offload(self, job: PreDraftJob, context: list[int]) -> list:
        """Root node 0's tree at the job's context (only where that runs no call) and send the drafter a
        snapshot with the rows its replica lacks: the committed rows past what it was last shipped."""
        from flowedge.engine.events import Offload

        d, cfg = self.drafter, self.config
        if not roots_free(d, context):   # rooting there would cost node 0 a call: no job this time
            self.out = None
            return []
        d.advance(context, 0, cfg.expansion_width, cfg.lookup_tokens)
        keep = next((i for i, (a, b) in enumerate(zip(self.shipped, context)) if a != b),
                    min(len(self.shipped), len(context)))
        snap = snapshot(d, context, keep, job.calls, cfg.expansion_width, cfg.lookup_tokens)
        if snap is None:   # the context left node 0's stored tree: nothing to continue
            self.out = None
            return []
        self.shipped = tuple(context)
        self.snaps[job.seq] = (job, snap)
        while len(self.snaps) > KEPT_SNAPSHOTS:
            self.snaps.popitem(last=False)
        return [Offload(job, snap, request_bytes=snap.nbytes())]

    def on_event(self, event: PreDraftStep | PreDrafted, context: list[int], now: float) -> tuple[list, bool]:
        """Run (idle) or merge (drafter) a job's calls on the tree at `context`. Returns the actions (node
        0's own draft costs) and whether to plan the next job."""
        from flowedge.engine.events import Compute, WhenIdle

        job = event.job
        if isinstance(event, PreDrafted):
            return self._answered(event, context)
        if job is not self.out:
            return [], False
        if not self.gaps.fits(now, self.call_s if self.call_s is not None else self.measured_s):
            self.out = None
            self.stats.skipped += 1
            return [], False
        made = self._grow(context)
        self._count(made)
        self.measured_s = sum(seconds for _, _, seconds in made) or self.measured_s
        actions: list = [Compute("draft", t, c, "predraft") for t, c, _ in made]
        self.done += 1
        if self.done < job.calls and made:
            return actions + [WhenIdle(event)], False
        self.out = None
        return actions, True

    def _answered(self, event: PreDrafted, context: list[int]) -> tuple[list, bool]:
        """Graft the drafter's answer (any job's: a late one still holds valid nodes under the new root)."""
        if event.job is self.out:
            self.out = None
        sent = self.snaps.get(event.job.seq)   # kept after an empty outcome: the answer may still come late
        if event.growth is not None:
            self.snaps.pop(event.job.seq, None)
        if event.growth is None or sent is None or sent[0] is not event.job:
            # no answer, or one for a job this engine no longer holds (e.g. before a replay): the next
            # job ships the whole context
            self.stats.unanswered += 1
            self.shipped = ()
            return [], False
        if tuple(context) != event.job.context:
            self.stats.late += 1
        nodes, rows = graft(self.drafter, event.growth, sent[1])
        self.stats.grafted += nodes
        self.stats.adopted += rows
        self.stats.calls += len(event.growth.calls)
        # an expansion may skip its call only for what the answer added: the drafter's best-first calls are
        # the ones node 0 makes itself after each walk, so a late answer often adds nothing (measured)
        self.since_expansion += rows
        return [], self.out is None

    def _grow(self, context: list[int]) -> list:
        """One best-first draft call on node 0's stored tree at `context`; the calls made."""
        cfg = self.config
        grown = self.drafter.advance(context, 1, cfg.expansion_width, cfg.lookup_tokens)
        return self.drafter.drain_calls() if grown is not None else []

    def _count(self, made: list) -> None:
        self.stats.calls += len(made)
        self.since_expansion += len(made)

    # ---- the expansion ------------------------------------------------------------------------------
    def base_for(self, context: list[int], tree: DraftTree, alive: torch.Tensor, cur: int) -> DraftTree | None:
        """The stored tree re-rooted at `context` if pre-drafting left it `min_fresh` nodes the round
        (`tree`, walking from `cur`) has not sent: the expansion takes them without a draft call (a hit).
        None: draft as usual (a miss, if pre-drafting ran since the last expansion)."""
        cfg = self.config
        before = self.drafter.forwards
        base = self.drafter.advance(context, 0, cfg.expansion_width, cfg.lookup_tokens)
        rooted_free = self.drafter.forwards == before   # re-rooting ran no call (the new root had run)
        fresh = 0 if base is None or not rooted_free else fresh_nodes(base, tree, alive, cur)
        return base if self._enough(fresh) else None

    def _enough(self, fresh: int) -> bool:
        ran, self.since_expansion = self.since_expansion > 0, 0
        hit = ran and fresh >= self.min_fresh
        if hit:
            self.stats.hits += 1
        elif ran:
            self.stats.misses += 1
        return hit
