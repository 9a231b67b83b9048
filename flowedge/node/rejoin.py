"""A daemon's node, run until it stops; a head that a standby deposed rejoins as that standby's standby.

A head that was only paused or cut off while its standby took over finds out by itself (node/deposition.py:
a higher term serves at a standby's address). Standing down alone would leave the cluster without a
standby until an operator restarts the board as one, so this process does it: the head ends its run (its
sockets closed, its ports released) and a standby is built from the head's own config, following the
head that serves now and serving, once it takes over in turn, where the old head listened. That address
is already in the stages' `heads` and the clients' lists, so a later failover back needs nobody either;
its term is whatever the new head's WELCOME says (the takeover after it, one more).

The standby takes over the plan the head holds (the split model and the draft model): no second copy in
memory beside the first, no reload, and its address answers at once, refusing HELLOs with a line naming
the new head, as the deposed head refused them naming it (clients trying their addresses in turn move on).

No opt-out: a deposed head serves nobody, and a standby costs nothing the head did not (the same models,
one idle poll loop). A board that should leave the cluster is stopped (`systemctl stop`), as before.

What this does not change: the config file still says `role = "head"`, so a restart of the process (a
reboot, a crash under systemd's `Restart=`) starts a head under term 1 again, which serves nobody (the
stages obey the higher term) and knows no standby to find that out from. Make it a standby for good by
its config (docs/operations.md).
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import replace

from flowedge.allocator import settle
from flowedge.errors import ConfigError
from flowedge.node.deposition import Deposed
from flowedge.node.head_node import HeadNode
from flowedge.node.head_search import HeadSearch
from flowedge.node.node_config import NodeConfig
from flowedge.node.partition_plan import Plan
from flowedge.node.roots import build_node, build_standby
from flowedge.node.standby import StandbyNode

log = logging.getLogger(__name__)

BIND_WAIT_S = 10.0   # the head's ports are free once its link closed; a slow release is waited out this long


def run_node(config: NodeConfig, stop: threading.Event, search: HeadSearch | None = None) -> None:
    """Build and run the node `config.role` names until it stops; each time its head is deposed, run on as
    the new head's standby."""
    node = build_node(config, stop, search=search, rejoins=True)
    while True:
        node.run()
        rejoin = _deposed(node)
        if rejoin is None or stop.is_set():
            return
        standby, plan, deposed = rejoin
        log.warning("deposed by term %d at %s: rejoining as its standby", deposed.term, deposed.address)
        del node   # the old head's engines and requests go; its models carry on in `plan`
        gc.unfreeze()   # they were frozen out of the collector's passes with the models: collected, refrozen
        settle()
        node = _build_standby(standby, plan, stop)


def standby_config(head: NodeConfig, deposed: Deposed) -> NodeConfig:
    """The standby a deposed head's process becomes: the head's own settings (its plan's), following the
    head that serves, and serving where this head listened once it takes over."""
    return replace(head, role="standby", head=deposed.address, listen=head.head)


def _deposed(node) -> tuple[NodeConfig, Plan | None, Deposed] | None:
    """The standby's config, the plan it keeps and who deposed the head, when `node` (a head, or a standby
    that took over) ended its run deposed; None otherwise."""
    head = node.head if isinstance(node, StandbyNode) else node
    if not isinstance(head, HeadNode) or not head.deposition.leaving:
        return None
    deposed = head.deposition.deposed
    assert deposed is not None   # `leaving` says so
    # the membership's config is the plan's (a re-plan around a lost board changes `stages` with it)
    return standby_config(head.members.config, deposed), head.members.plan, deposed


def _build_standby(config: NodeConfig, plan: Plan | None, stop: threading.Event) -> StandbyNode:
    """The standby, once the old head's ports can be listened on again (at once, as a rule)."""
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        try:
            return build_standby(config, stop, plan=plan, rejoins=True)
        except ConfigError as err:
            if time.monotonic() > deadline or stop.is_set():
                raise
            log.info("rejoining as a standby: %s; trying again", err)
            stop.wait(0.2)
