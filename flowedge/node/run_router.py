"""The head's boundary for what the pipeline says about an engine run: which running request a run id
names, and whether a segment coming back can still be used. Checked here once, on arrival.

Ids. A request has three, each for its own job, and each named for what it holds:
- the client's `request_id` (PromptRequest, TokenChunk, ErrorReply, Cancel, the standby's log): unique on
  its client's connection only (two clients may both send request 1), so the head never keys on it;
- the scheduler's request `key` (engine/scheduler.py, `HeadRequests.clients`): unique on this head and
  kept for the request's whole life, replays included. It stays apart from the client's id for the
  reason above: unifying the two would need a (connection, request_id) key in the sans-IO scheduler
  that the simulator shares, for no gain on the wire, where the key never travels;
- the engine's `run_id` (`jobs.Request.run_id`, the data plane's `run_id` fields): one run of the
  request's engine. The first run's is the key, a replay's key + (replay << 32) (`Request.next_run_id`),
  so a late segment of the run a replay replaced names a run that no longer exists and is dropped here,
  never taken for the new run's.

Rounds. A segment of a round that has ended is dropped without a count (the engine would skip it: its
round ended with segments still in flight); one of a round the engine has not begun is dropped and counted
under `round_id` (the engine numbers a round before it sends its first segment, so it was never sent).
A prefill chunk has no round. Checked on arrival rather than when a step takes the segment: queued, a
flood of either grew the request's work one item per turn faster than the turns took them. A segment of
the current round is then checked against the nodes its engine has sent (`check_returned_segment`): a
round's tree only grows, so the ids sent by the time a segment arrives are all it can rightly name. One
that waits in its request's queue behind work that ends the round becomes stale there; the engine drops
that one itself (engine/head.py), as it does under the simulator, which has no router.
"""
from __future__ import annotations

from collections.abc import Callable

from flowedge.node.droplog import DropLog
from flowedge.node.head_requests import HeadRequests
from flowedge.transport import protocol as proto
from flowedge.transport.validate import InvalidMessage, ReturnPlan, check_returned_segment


class RunRouter:
    """Run id -> the request and engine running it, for the head node's data plane and stage notices.
    `return_plan()`: what the plan in force accepts back (`HeadEngines.return_plan`)."""

    def __init__(self, requests: HeadRequests, return_plan: Callable[[], ReturnPlan], drops: DropLog) -> None:
        self.requests, self.return_plan, self.drops = requests, return_plan, drops

    def segment(self, msg: proto.Segment, now: float) -> bool:
        """A segment back from the last stage: queued on its run's request (True) or dropped (False)."""
        engine = self.requests.scheduler.running_engine(msg.run_id)
        if engine is None:   # a run that ended, paused, was replaced by a replay or never began
            return False
        if not self._in_round(engine, msg):
            return False
        known = int(engine.alive.numel()) if hasattr(engine, "alive") else 0   # node ids the engine indexes
        try:
            check_returned_segment(msg, self.return_plan(), known)
        except InvalidMessage as err:
            self.drops.drop(err.rule, f"pipeline return: {err}")
            return False
        self.requests.add_segment(msg.run_id, msg, now)
        return True

    def _in_round(self, engine, msg: proto.Segment) -> bool:
        """A prefill chunk, or a segment of the round `engine` is in (an engine without rounds takes all)."""
        current = getattr(engine, "round_id", None)
        if current is None or msg.kind == "prefill" or msg.round_id == current:
            return True
        if msg.round_id > current:
            self.drops.drop("round_id", f"pipeline return: round {msg.round_id} of run {msg.run_id}, "
                                        f"which is in round {current}")
        return False

    def dropped(self, run_id: int, reason: str) -> None:
        """A stage freed run `run_id`: its request fails now, saying why. A notice about a run that is no
        longer current (paused, replayed, ended) is ignored: the request has moved on without it."""
        req = self.requests.scheduler.by_run.get(run_id)
        if req is not None:
            self.requests.fail(req.key, f"a stage gave up on it ({reason})")
