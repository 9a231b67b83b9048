"""What a head node runs with: its endpoints and the parts with one job each, built from the config by
`roots.build_head` and handed to `HeadNode` whole, so the node itself wires nothing."""
from __future__ import annotations

from dataclasses import dataclass

from flowedge.node.draft_dispatch import DraftDispatch
from flowedge.node.droplog import DropLog
from flowedge.node.head_engines import HeadEngines
from flowedge.node.head_ports import ControlPort, HeadOutbox
from flowedge.node.head_requests import HeadRequests
from flowedge.node.membership import Membership
from flowedge.node.replication import Replicator, RequestLog
from flowedge.node.run_router import RunRouter
from flowedge.node.shrink import Shrinker
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
    router: RunRouter       # run id -> request, and the one check of a returned segment's round
    shrink: Shrinker | None = None     # re-plans onto the survivors of a board lost for good
    drafts: DraftDispatch | None = None   # pre-draft jobs for drafter nodes
    replica: Replicator | None = None     # the request log to standby heads (node/replication.py)
    resumes: RequestLog | None = None     # a head that took over: the log it resumes requests from
    rejoins: bool = False                 # deposed, its process rejoins as a standby (node/rejoin.py)
