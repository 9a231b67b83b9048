"""`flowedge status`: the table of nodes, and `--watch`, the same refreshed in place with rates.

`render` is pure (status replies in, text out) so it is tested without a terminal; `watch` redraws
with two ANSI sequences (cursor home, clear to the end), which every terminal and `watch`-like
multiplexer understands.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from flowedge.launch.standby_view import standby_lines

CLEAR = "\x1b[H\x1b[J"


def node_table(nodes: list[dict]) -> list[str]:
    """One row per node. `model`: the first digits of the content key of the model whose layers the node
    holds (the head: the model it serves), so a stage of another model stands out."""
    lines = [f"{'node':<18} {'role':<7} {'layers':<12} {'model':<12} {'address':<22} {'rss MB':>7} {'load':>5} "
             f"{'seen s':>6} {'step ms':>8} {'rtt ms':>7}  state"]
    for n in nodes:
        layers = n.get("layers")
        layers = f"[{layers[0]}, {layers[1]})" if isinstance(layers, list) and layers else str(layers or "")
        step, rtt = n.get("step_ms_median"), n.get("rtt_ms")   # rtt: the head's link to the node
        state = "missing" if n.get("missing") else ("ready" if n.get("ready") else "not ready")
        if n.get("error"):   # e.g. a stage that could not take its assignment
            state += f"; {n['error']}"
        dropped = n.get("dropped")
        if isinstance(dropped, dict) and dropped:   # messages the node refused, by rule
            state += f"; dropped {sum(dropped.values())} (" + ", ".join(
                f"{rule} {count}" for rule, count in sorted(dropped.items())) + ")"
        model = str(n.get("model_sha256") or "-")[:12]
        lines.append(f"{n.get('node_id') or '-':<18} {n['role']:<7} {layers[:12]:<12} {model:<12} "
                     f"{n.get('address', ''):<22} "
                     f"{(n.get('rss_bytes') or 0) / 1e6:>7.0f} {n.get('load', 0) or 0:>5.2f} "
                     f"{n.get('last_seen_s', 0) or 0:>6.1f} {step if step is not None else '-':>8} "
                     f"{rtt if rtt is not None else '-':>7}  {state}")
    return lines


def summary(nodes: list[dict], before: list[dict] | None, interval_s: float) -> str:
    """One line about the work: queued and running requests, tokens/s now, what was served, the last
    answer's figures. The head's own live figures when it has them (the numbers /metrics and the dashboard
    show too); from two replies' token counts for an older head."""
    head = nodes[0] if nodes else {}
    served = head.get("served") or {}
    live = head.get("requests") or {}
    accept = (head.get("last_request") or {}).get("mean_accept_len")
    accepts = [r["mean_accept_len"] for r in live.get("active", []) if r.get("mean_accept_len") is not None]
    now = f"   running now: accepted length {sum(accepts) / len(accepts):.2f}" if accepts else ""
    last = head.get("last_request") or {}
    return (f"{work_now(head)}   tokens/s {rate(head, before, interval_s)}   served {served.get('requests', 0)} "
            f"(rejected {served.get('rejected', 0)}, failed {served.get('failed', 0)}, cancelled "
            f"{served.get('cancelled', 0)})   last answer: {last.get('tokens_per_s', '-')} tok/s, accepted length "
            f"{accept if accept is not None else '-'}, {last.get('strategy', '-')}{now}")


def work_now(head: dict) -> str:
    """Requests queued and running (paused ones apart), or the head's one `queue` count if that is all."""
    live = head.get("requests")
    if not isinstance(live, dict) or "queued" not in live:
        return f"queue {head.get('queue', 0)}"
    paused = f" ({live['paused']} paused)" if live.get("paused") else ""
    return f"queued {live.get('queued', 0)}   running {live.get('running', 0)}{paused}"


def rate(head: dict, before: list[dict] | None, interval_s: float) -> str:
    """Tokens a second now, as the head measures them; else over the interval between two replies."""
    live = head.get("requests") or {}
    if isinstance(live.get("tokens_per_s"), (int, float)):
        return f"{live['tokens_per_s']:.2f}"
    if not before or interval_s <= 0:
        return "-"
    made = (head.get("served") or {}).get("tokens", 0) - ((before[0].get("served") or {}).get("tokens", 0))
    return f"{max(0, made) / interval_s:.2f}"


def auto_line(nodes: list[dict]) -> list[str]:
    """Strategy `auto`'s latest choice and why (engine/auto_policy.py), when the head has one."""
    auto = (nodes[0] if nodes else {}).get("auto") or {}
    if not auto:
        return []
    return [f"auto: {auto.get('choice')} ({auto.get('reason')}); the last answer ended on {auto.get('final')} "
            f"after {len(auto.get('switches', []))} switch(es)"]


def predraft_line(nodes: list[dict]) -> list[str]:
    """What pre-drafting did for the latest answer that used it (engine/predraft.py)."""
    pre = (nodes[0] if nodes else {}).get("predraft") or {}
    if not pre:
        return []
    rate = pre.get("hit_rate")
    return [f"pre-drafting: {pre.get('calls')} calls off the critical path, {pre.get('critical_draft_calls')} on it; "
            f"hit rate {'-' if rate is None else f'{100 * rate:.0f}%'} ({pre.get('hits')} hits, {pre.get('misses')} "
            f"misses), {pre.get('skipped_idle_calls')} idle calls skipped (the next segment was due)"]


def drafter_line(nodes: list[dict]) -> list[str]:
    """The head's pre-draft jobs for drafter nodes since it started (node/draft_dispatch.py)."""
    jobs = (nodes[0] if nodes else {}).get("drafter_jobs") or {}
    if not jobs.get("jobs"):
        return []
    return [f"drafter jobs: {jobs.get('sent')} sent to {jobs.get('drafters')} drafter(s), {jobs.get('answered')} "
            f"answered, {jobs.get('behind')} behind, {jobs.get('timed_out')} timed out ({jobs.get('late_grafted', 0)} "
            f"of them grafted late), {jobs.get('drafter_lost')} "
            f"lost with a drafter, {jobs.get('no_drafter')} with none joined (node 0 drafted alone)"]


def client_table(nodes: list[dict]) -> list[str]:
    """The head's queue per client (engine/fair_queue.py), when any client has requests there or was refused."""
    rows = (nodes[0] if nodes else {}).get("clients") or []
    if not rows:
        return []
    lines = ["", f"{'client':<40} {'weight':>6} {'queued':>6} {'running':>7} {'refused':>7}"]
    for r in rows:
        lines.append(f"{str(r.get('client') or '-')[:40]:<40} {r.get('weight', 1):>6g} {r.get('queued', 0):>6} "
                     f"{r.get('running', 0):>7} {r.get('refused', 0):>7}")
    return lines


def membership_lines(nodes: list[dict]) -> list[str]:
    """Boards lost, re-plans onto the boards left and spares waiting (node/shrink.py), the last few."""
    m = (nodes[0] if nodes else {}).get("membership") or {}
    events, spares = m.get("events") or [], m.get("spares") or []
    lines = [f"membership: {e.get('kind')}: {e.get('text')}" for e in events[-5:]]
    return lines + ([f"spares: {', '.join(map(str, spares))}"] if spares else [])


def render(nodes: list[dict], before: list[dict] | None = None, interval_s: float = 0.0) -> str:
    return "\n".join([*node_table(nodes), "", summary(nodes, before, interval_s), *auto_line(nodes),
                      *predraft_line(nodes), *drafter_line(nodes), *membership_lines(nodes), *standby_lines(nodes),
                      *client_table(nodes)])


def watch(fetch: Callable[[], list[dict]], echo: Callable[[str], None], interval_s: float,
          iterations: int | None = None) -> None:
    """Redraw the status every `interval_s` until interrupted (or `iterations` redraws)."""
    before, t_before = None, time.monotonic()
    count = 0
    while iterations is None or count < iterations:
        nodes = fetch()
        now = time.monotonic()
        echo(CLEAR + render(nodes, before, now - t_before) + f"\n\nevery {interval_s:g} s; Ctrl-C stops")
        before, t_before = nodes, now
        count += 1
        if iterations is None or count < iterations:
            time.sleep(interval_s)
