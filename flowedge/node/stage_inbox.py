"""A stage's inbound data path made safe: check each message, run the worker, contain its failures.

Every Segment, Prune or Reset a stage receives (from the previous hop or from the head) passes
through `StageInbox.admit`: a message that breaks a data-plane rule (transport/validate.py) or that
would take a request past the node's bounds (its context, its backlog, the number of live requests)
is dropped and counted. `StageInbox.run` hands the admitted events to the worker as one batch; the
worker contains failures per request (an error while running one request frees that request alone,
even inside a batched forward: see stage_worker.py), each counted here as `request_failed`. Should
anything still escape the worker, the requests of that batch are freed and the node keeps serving.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from flowedge.engine.events import Compute, Failed, Finish, Send
from flowedge.engine.stage_worker import StageWorker
from flowedge.errors import ProtocolError
from flowedge.node import wire
from flowedge.node.droplog import DropLog
from flowedge.transport import protocol as proto
from flowedge.transport.validate import InvalidMessage, StagePlan, check_stage_input

log = logging.getLogger(__name__)

MAX_PENDING = 1024       # segments and prunes a request may hold back waiting for an older prune
MAX_LIVE_REQUESTS = 256  # requests a stage holds KV caches for at once
KV_ROOM_CONTEXTS = 2     # most KV entries one request may hold, in model contexts (committed + unpruned rows)


@dataclass(frozen=True, slots=True)
class Handled:
    """What one batch produced: wire messages for the next hop, and whether layers ran."""

    sends: list[proto.Message] = field(default_factory=list)
    computed: bool = False


def plan_for(worker: StageWorker, hidden_wire: str) -> StagePlan:
    """The plan a stage checks its input against: its model's width and context, the wire dtype."""
    config = worker.model.config
    return StagePlan(hidden_size=int(config.hidden_size), hidden_wire=hidden_wire,
                     max_positions=int(getattr(config, "max_position_embeddings", 1 << 20)))


class StageInbox:
    def __init__(self, worker: StageWorker, plan: StagePlan, drops: DropLog) -> None:
        self.worker = worker
        worker.contain_failures = True   # a request's error fails that request, not its batch-mates
        self.plan = plan
        self.drops = drops
        self.freed: list[tuple[int, str]] = []   # runs this stage gave up on, and why: the head is told

    def admit(self, msg: proto.Message) -> object | None:
        """The engine event for `msg`, or None when it is dropped (counted, logged without flooding)."""
        try:
            check_stage_input(msg, self.plan)
            self._check_room(msg)
            return wire.from_wire(msg, self.worker.model.dtype)
        except InvalidMessage as err:
            self.drops.drop(err.rule, f"{msg.TYPE} of run {getattr(msg, 'run_id', '?')}: {err}")
        except ProtocolError as err:   # the adapter's: fields valid alone that break a rule across them
            self.drops.drop("malformed", str(err))
        except Exception as err:  # noqa: BLE001 - a conversion the checks did not foresee: drop, never crash
            self.drops.drop("unconvertible", f"{msg.TYPE}: {proto.bounded(repr(err), 300)}", exc_info=True)
        return None

    def run(self, events: list) -> Handled:
        """Run admitted events as one batch; never raises for anything a peer can send."""
        try:
            actions = self.worker.receive_all(events)
            sends = [wire.to_wire(a.message, self.plan.hidden_wire) for a in actions if isinstance(a, Send)]
        except Exception as err:  # noqa: BLE001 - one bad request must never take the stage down
            failed = sorted({e.run_id for e in events})
            self.drops.drop("request_failed", f"requests {failed} failed: {proto.bounded(repr(err), 300)}",
                            level=logging.ERROR, exc_info=True)
            for rid in failed:
                self._free(rid, f"a compute error: {proto.bounded(repr(err), 200)}")
            return Handled()
        for a in actions:
            if isinstance(a, Failed):
                self.drops.drop("request_failed", f"request {a.run_id} failed: {proto.bounded(a.error, 300)}",
                                level=logging.ERROR)
                self.freed.append((a.run_id, f"a compute error: {proto.bounded(a.error, 200)}"))
        return Handled(sends, any(isinstance(a, Compute) for a in actions))

    def handle(self, msg: proto.Message) -> Handled:
        """One message alone: admit it and run it."""
        event = self.admit(msg)
        return self.run([event]) if event is not None else Handled()

    def _check_room(self, msg: proto.Message) -> None:
        """Stateful bounds: live requests, a request's backlog, its KV cache within the model's context."""
        if not isinstance(msg, (proto.Segment, proto.Prune)):
            return
        if isinstance(msg, proto.Segment) and msg.kind == "prefill" and int(msg.positions[0]) == 0:
            if msg.run_id not in self.worker.slots and len(self.worker.slots) >= MAX_LIVE_REQUESTS:
                self.freed.append((msg.run_id, f"it already holds {MAX_LIVE_REQUESTS} requests"))
                raise InvalidMessage("too_many_requests", f"this stage already holds {MAX_LIVE_REQUESTS}")
            return   # (re)starts the request from an empty cache
        slot = self.worker.slots.get(msg.run_id)
        if slot is None:
            return   # the worker ignores messages of requests it does not hold
        if len(slot.waiting) + len(slot.pending_prunes) >= MAX_PENDING:
            self._free(msg.run_id, "the run fell out of step (a prune set never came)")
            raise InvalidMessage("request_out_of_step", f"more than {MAX_PENDING} messages wait for a "
                                                        "prune that never came: request freed")
        # A memory bound, not the context rule (each row's position is checked against the context in
        # validate.py): the last round's rows stay cached until its prune set, which travels apart from
        # the segments, is applied, so a next round's segment may rightly arrive while they are held.
        held, limit = slot.cache.length, KV_ROOM_CONTEXTS * self.plan.max_positions
        if isinstance(msg, proto.Segment) and held + len(msg) > limit:
            self._free(msg.run_id, f"its KV cache would pass {limit:g} entries")
            raise InvalidMessage("context_full", f"{held} + {len(msg)} cache entries exceed {limit:g} "
                                                 f"({KV_ROOM_CONTEXTS:g} x the model's context): request freed")

    def _free(self, run_id: int, reason: str) -> None:
        self.worker.receive_all([Finish(run_id)])
        self.freed.append((run_id, reason))

    def take_freed(self) -> list[tuple[int, str]]:
        """The runs given up on since the last call, and why."""
        freed, self.freed = self.freed, []
        return freed
