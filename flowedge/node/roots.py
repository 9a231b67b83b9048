"""The composition roots of the node processes: each builds every part of one node from its config and
hands them to the node's constructor, so no node opens sockets or patches its parts itself.

The link is the one thing a caller may give: `ZmqLink` (the default: real sockets, CurveZMQ unless
`insecure`) for the daemons, a `MemoryLink` for a whole cluster in one test process.
"""
from __future__ import annotations

import threading
from dataclasses import replace

from flowedge.engine.jobs import Limits
from flowedge.errors import AddressInUse, ConfigError
from flowedge.node import drafter_node, head_node, stage_node, wire
from flowedge.node.data_port import bind_data_port
from flowedge.node.draft_dispatch import DraftDispatch
from flowedge.node.drafter_node import DrafterNode
from flowedge.node.droplog import DropLog
from flowedge.node.head_engines import HeadEngines
from flowedge.node.head_node import HeadNode
from flowedge.node.head_parts import HeadParts
from flowedge.node.head_ports import ControlPort, HeadOutbox
from flowedge.node.head_requests import HeadRequests, request_scheduler
from flowedge.node.head_search import HeadSearch
from flowedge.node.membership import Membership
from flowedge.node.node_base import NodeParts
from flowedge.node.node_config import NodeConfig, flowedge_home
from flowedge.node.partition_plan import Plan, Replanner
from flowedge.node.replication import ReplicatingOut, Replicator, RequestLog
from flowedge.node.run_router import RunRouter
from flowedge.node.shrink import Shrinker
from flowedge.node.stage_node import StageNode, StageNodeParts
from flowedge.node.standby import StandbyNode
from flowedge.transport.addresses import split_addr
from flowedge.transport.link import Endpoint, Kind, Link
from flowedge.transport.zmq_link import ZmqLink


def node_link(config: NodeConfig) -> Link:
    """The daemons' link: ZeroMQ with the cluster's keys (or without, `insecure`)."""
    return ZmqLink(config.keys_path, config.insecure)


def build_head(config: NodeConfig, stop: threading.Event | None = None, link: Link | None = None,
               resumes: RequestLog | None = None, rejoins: bool = False) -> HeadNode:
    """A head listening at `config.head` (control) and the port after it (the pipeline's return); `resumes`:
    a standby's request log, for the head it becomes (node/standby.py); `rejoins`: once deposed, the head
    ends its run so that its process rejoins as a standby (node/rejoin.py)."""
    if config.role != "head":
        raise ConfigError("a head needs role = 'head'")
    link = link or node_link(config)
    try:
        host, port = split_addr(config.head)
        ctrl = _listen(link, Kind.ROUTER, host, port)
        ret = _listen(link, Kind.INBOUND, host, port + 1)
    except BaseException:
        link.close()
        raise
    control = ControlPort(ctrl, wire.WireCounter(curve=not config.insecure))
    drops = DropLog(head_node.log)
    members = Membership(config, control.send, replanner=Replanner(config, flowedge_home()), drops=drops)
    engines = HeadEngines(config, members, drops)
    scheduler = request_scheduler(engines, Limits(   # first: the draft dispatcher hands it the drafters' answers
        recovery_s=config.recovery_s, stall_s=config.stall_timeout_s, max_running=config.max_concurrent,
        max_queued_per_client=config.max_queued_per_client))
    drafts = DraftDispatch(members, control.send, lambda: engines.in_force.draft_model, drops, scheduler.deliver)
    outbox = HeadOutbox(link, control, members, config.wire_dtype, drafts)
    replica = Replicator(control, members, config.name, config.heartbeat_ms / 1000)
    requests = HeadRequests(engines, ReplicatingOut(outbox, replica), client_weights=config.client_weights,
                            scheduler=scheduler)
    shrink = Shrinker(config, members, engines, requests, flowedge_home())
    router = RunRouter(requests, engines.return_plan, drops)
    return HeadNode(config, HeadParts(link, ctrl, ret, control, outbox, members, engines, requests, drops, router,
                                      shrink, drafts, replica, resumes, rejoins), stop)


def _listen(link: Link, kind: Kind, host: str, port: int) -> Endpoint:
    try:
        return link.listen(kind, "*" if host in ("0.0.0.0", "*") else host, (port, port))
    except AddressInUse as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err} (is another head running?)") from None


def build_stage(config: NodeConfig, stop: threading.Event | None = None, link: Link | None = None,
                search: HeadSearch | None = None) -> StageNode:
    """A stage with its data port listening (on the interface the head is reached through); `search`: the
    head was found by mDNS, and may be looked for again (head_search.py)."""
    link = link or node_link(config)
    try:
        data_in, data_addr = bind_data_port(link, config, split_addr(config.head)[0])
    except BaseException:
        link.close()
        raise
    parts = StageNodeParts(link, DropLog(stage_node.log), flowedge_home(), data_in=data_in, data_addr=data_addr,
                           search=search)
    return StageNode(config, parts, stop)


def build_drafter(config: NodeConfig, stop: threading.Event | None = None, link: Link | None = None,
                  search: HeadSearch | None = None) -> DrafterNode:
    """A drafter: it only dials the head (jobs and answers share the control connection)."""
    parts = NodeParts(link or node_link(config), DropLog(drafter_node.log), flowedge_home(), search=search)
    return DrafterNode(config, parts, stop)


def build_standby(config: NodeConfig, stop: threading.Event | None = None, link: Link | None = None,
                  plan: Plan | None = None, rejoins: bool = False) -> StandbyNode:
    """A standby head (node/standby.py): the head it may become, built now (its address listens, its models
    load before it follows the head, unless `plan` hands it those of a deposed head), and the request log
    they share."""
    if not config.listen:
        raise ConfigError("a standby needs `listen` (HOST:PORT, or `join --standby --listen`): where it serves "
                          "once it takes over")
    entries = RequestLog()
    head = build_head(replace(config, role="head", head=config.listen), stop, link, resumes=entries, rejoins=rejoins)
    return StandbyNode(config, head, entries, stop, plan)


def build_node(config: NodeConfig, stop: threading.Event | None = None, link: Link | None = None,
               search: HeadSearch | None = None, rejoins: bool = False):
    """The node `config.role` names; `search` only for a stage or drafter that found its head by mDNS;
    `rejoins`: a head (or a standby once it took over) that is deposed ends its run (node/rejoin.py)."""
    if config.role == "head":
        return build_head(config, stop, link, rejoins=rejoins)
    if config.role == "standby":
        return build_standby(config, stop, link, rejoins=rejoins)
    return {"stage": build_stage, "drafter": build_drafter}[config.role](config, stop, link, search)
