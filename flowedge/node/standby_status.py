"""What the operator sees of the standby heads, node side: the head's rows for the standbys that follow it
(`flowedge status`, the dashboard, /v1/status) and the figures a standby reports with its heartbeats.

How far behind a standby is: the head counts the log tokens it sent each standby (`Replicator.sent`), the
standby counts those it applied and says so with every heartbeat; the difference is what was on the way
(or lost) when that heartbeat left. `state_age_s` is how old the head's last HeadState was at the standby.

A standby asked at its own address answers with a refusal (transport/msg_standby.py's wording), which
`flowedge status` turns into the standby's row (launch/standby_view.py).
"""
from __future__ import annotations

import time
from typing import Any


def beat_stats(applied_tokens: int, state_s: float | None, now: float | None = None) -> dict[str, Any]:
    """A standby's heartbeat stats: log tokens applied, and the age of the head's last HeadState."""
    now = time.monotonic() if now is None else now
    stats: dict[str, Any] = {"log_tokens": applied_tokens}
    if state_s is not None:
        stats["state_age_s"] = round(max(0.0, now - state_s), 3)
    return stats


def standby_rows(replica, members, now: float | None = None) -> list[dict[str, Any]]:
    """The head's row per standby following it: who, where it serves once it takes over, when it was last
    heard, and how far its log is behind."""
    if replica is None:
        return []
    now = members.clock() if now is None else now
    rows = []
    for identity in replica.standbys:
        peer = members.peers.get(identity)
        if peer is None:
            continue
        sent = replica.sent.get(identity, 0)
        applied = peer.stats.get("log_tokens")
        rows.append({
            "node_id": peer.name, "address": str(peer.hello.capabilities.get("listen") or ""),
            "last_seen_s": round(now - peer.last_seen, 3), "log_sent_tokens": sent,
            "log_applied_tokens": applied, "log_behind_tokens": None if applied is None else max(0, sent - applied),
            "state_age_s": peer.stats.get("state_age_s"),
        })
    return rows
