"""`flowedge status` and the standby heads: a standby's answer read back into its row when status is asked at
its own address (it refuses every HELLO until it takes over, naming the head it follows and the term), and
the lines under the node table for the head's fencing term, its standbys and a deposition."""
from __future__ import annotations

from typing import Any

from flowedge.errors import FlowedgeError
from flowedge.transport.msg_standby import STANDBY_REFUSAL


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
