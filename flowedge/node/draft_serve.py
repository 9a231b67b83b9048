"""The drafter role's job handler, no sockets: a pre-draft job's frames in, the answer out.

One `DrafterDevice` (engine/draft_sync.py) holds a replica of node 0's draft state per request; a job
loads node 0's snapshot into it and grows the tree by the job's calls. Whatever a job holds, the handler
answers: a `DraftAnswer`, a `DraftDeclined("behind")` when the replica lacks the rows the job assumed
(node 0 then ships the whole context), or a `DraftDeclined("error")` naming what was wrong with it.
Malformed peer input never ends the drafter: the node keeps serving the next job.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Sequence

from flowedge.engine.draft_sync import DrafterDevice, ReplicaBehind
from flowedge.errors import FlowedgeError, ProtocolError
from flowedge.node import draft_wire
from flowedge.node.droplog import DropLog
from flowedge.transport import protocol as proto

log = logging.getLogger(__name__)


class DraftServer:
    def __init__(self, model, drops: DropLog, max_requests: int = 8) -> None:
        self.model, self.drops = model, drops
        self.device = DrafterDevice(model, max_requests)
        self.counts = {"jobs": 0, "answered": 0, "behind": 0, "errors": 0}
        self.job_s: deque[float] = deque(maxlen=256)

    def handle(self, frames: Sequence) -> proto.Message:
        """The answer to one message from the head that should be a job."""
        self.counts["jobs"] += 1
        try:
            msg = proto.decode(frames)
        except ProtocolError as err:
            return self._error(0, 0, f"malformed draft job: {err}")
        if not isinstance(msg, proto.DraftJob):
            return self._error(0, 0, f"expected a draft_job, got {msg.TYPE}")
        return self.run(msg)

    def run(self, job: proto.DraftJob) -> proto.Message:
        t0 = time.perf_counter()
        try:
            snap = draft_wire.snapshot_of(job, self.model)
            growth = self.device.run(job.request_id, snap)
        except ReplicaBehind as why:
            self.counts["behind"] += 1
            self.device.forget(job.request_id)
            return proto.DraftDeclined(request_id=job.request_id, seq=job.seq, why="behind", detail=str(why))
        except FlowedgeError as err:
            return self._error(job.request_id, job.seq, str(err), forget=True)
        except Exception as err:  # noqa: BLE001 - a job that trips the engine must not end the drafter
            log.exception("draft job %d of request %d", job.seq, job.request_id)
            return self._error(job.request_id, job.seq, f"{type(err).__name__}: {err}", forget=True)
        self.job_s.append(time.perf_counter() - t0)
        self.counts["answered"] += 1
        return draft_wire.answer_message(job.request_id, job.seq, growth)

    def _error(self, key: int, seq: int, why: str, forget: bool = False) -> proto.DraftDeclined:
        """A job that could not run: its replica (half loaded, maybe) is dropped, so the next job of that
        request must ship the whole context (its keep > 0 is then answered `behind`)."""
        self.counts["errors"] += 1
        self.drops.drop("draft_job", why)
        if forget:
            self.device.forget(key)
        return proto.DraftDeclined(request_id=key, seq=seq, why="error", detail=proto.bounded(why, 1000))

    def stats(self) -> dict:
        recent = list(self.job_s)
        return {**self.counts, "replicas": len(self.device.replicas),
                "job_ms_median": round(1000 * statistics.median(recent), 3) if recent else None}
