"""What the operator sees of the standby heads: the head's rows for the standbys that follow it (`flowedge
status`, the dashboard, /v1/status), the figures a standby reports with its heartbeats, and a standby's own
answer when asked directly.

How far behind a standby is: the head counts the log tokens it sent each standby (`Replicator.sent`), the
standby counts those it applied and says so with every heartbeat; the difference is what was on the way
(or lost) when that heartbeat left. `state_age_s` is how old the head's last HeadState was at the standby.

A standby asked for status at its own address refuses the HELLO, as it refuses every HELLO before it takes
over (a client trying addresses in turn must move on at once); the refusal names the head it follows and
the term, and `status_of` turns such a refusal into the standby's one row.
"""
from __future__ import annotations

import re
import time
from typing import Any

from flowedge.errors import FlowedgeError

STANDBY_REFUSAL = re.compile(r"(?P<name>\S+) is a standby, not the head \(the head is at (?P<head>\S+?)"
                             r"(?:, term (?P<term>\d+))?\)")


def refusal(name: str, head: str, term: int) -> str:
    """The reason a standby gives a HELLO at its own address (parsed back by `standby_row`)."""
    return f"{name} is a standby, not the head (the head is at {head}, term {term})"


def standby_row(error: str, address: str) -> dict[str, Any] | None:
    """The row a standby's refusal stands for (None: not a standby's refusal)."""
    m = STANDBY_REFUSAL.search(error)
    if m is None:
        return None
    return {"node_id": m["name"], "role": "standby", "address": address, "follows": m["head"],
            "term": int(m["term"]) if m["term"] else None, "ready": False}


def status_of(client) -> list[dict[str, Any]]:
    """`client.status()`; at a standby's address, the standby's own row (role, the head it follows, term)."""
    try:
        return client.status()
    except FlowedgeError as err:
        row = standby_row(str(err), client.addr)
        if row is None:
            raise
        return [row]


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


def standby_lines(nodes: list[dict]) -> list[str]:
    """`flowedge status`'s lines: the head's fencing term and its standbys; or, asked at a standby, what it
    follows."""
    first = nodes[0] if nodes else {}
    if first.get("role") == "standby":
        return [f"{first.get('node_id')} is a standby head: it follows the head at {first.get('follows')} "
                f"(term {first.get('term') if first.get('term') is not None else '?'}) and takes over when it is "
                f"lost"]
    if first.get("term") is None:
        return []
    rows = first.get("standbys") or []
    lines = [first["deposed"]] if first.get("deposed") else []
    lines.append(f"fencing term {first['term']}; standby heads: {len(rows) or 'none'}")
    for r in rows:
        behind = r.get("log_behind_tokens")
        age = r.get("state_age_s")
        lines.append(f"  standby {r.get('node_id') or '-'} at {r.get('address') or '-'}: heard {r.get('last_seen_s')} "
                     f"s ago, log {'-' if behind is None else behind} tokens behind "
                     f"({r.get('log_applied_tokens')} of {r.get('log_sent_tokens')}), head state "
                     f"{'-' if age is None else age} s old")
    return lines
