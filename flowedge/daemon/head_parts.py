"""What a head node runs with: its endpoints and the parts with one job each, built from the config by
`roots.build_head` and handed to `HeadNode` whole, so the node itself wires nothing."""
from __future__ import annotations

from dataclasses import dataclass

from flowedge.daemon.draft_dispatch import DraftDispatch
from flowedge.daemon.droplog import DropLog
from flowedge.daemon.head_engines import HeadEngines
from flowedge.daemon.head_ports import ControlPort, HeadOutbox
from flowedge.daemon.membership import Membership
from flowedge.daemon.replication import Replicator, RequestLog
from flowedge.daemon.requests import HeadRequests
from flowedge.daemon.shrink import Shrinker
from flowedge.transport.link import Endpoint, Link


@dataclass
class HeadParts:
    """Everything a head runs with, built from the config by `roots.build_head`."""
    link: Link
    ctrl: Endpoint          # ROUTER: stages' and clients' control connections
    ret: Endpoint           # INBOUND: the last stage's returns
    port: ControlPort
    outbox: HeadOutbox
    members: Membership
    engines: HeadEngines
    requests: HeadRequests
    drops: DropLog
    shrink: Shrinker | None = None     # re-plans onto the survivors of a board lost for good
    drafts: DraftDispatch | None = None   # pre-draft jobs for drafter nodes
    replica: Replicator | None = None     # the request log to standby heads (daemon/replication.py)
    resumes: RequestLog | None = None     # a head that took over: the log it resumes requests from
