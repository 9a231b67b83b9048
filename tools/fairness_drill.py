"""Fair queuing drill on real processes: one client floods the head over ZeroMQ and over HTTP, another
client's short request must still be answered about as soon as a running slot frees.

    python tools/fairness_drill.py                      # tiny pair, 400 + 400 flood requests
    python tools/fairness_drill.py --flood 400 --json fairness.json

It starts a local cluster (`flowedge up`'s code, tiny pair in a temporary home) and its HTTP front with two
API keys, measures the polite client's 8-token answer on the idle cluster (median of 3, over ZeroMQ and
over HTTP), then sends the flood (64-token requests, all at once, on one ZeroMQ connection and under one
HTTP key) and, once the head holds the flood's whole queue, the polite request again on each channel. The
bound it checks is the one the head promises: polite time <= 2 x idle time + one running request's time.
The flood past its per-client cap must be refused with `Busy` (ZeroMQ) or 429 `queue_full` (HTTP).

It cannot hang: every request has --timeout s (a non-answer is counted as such, by its error's name),
waiting for the flood's queue to fill gives up after --timeout s, and the whole drill after --deadline s.
The exit status is 0 only if both polite answers came within the bound, the same as on the idle cluster.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import soak
from flowedge.client.async_client import AsyncClient

log = logging.getLogger("fairness")

PROMPT = "def fibonacci(n):"
FLOOD_KEY, POLITE_KEY = "flood-key-0123456789abcdef", "polite-key-0123456789abcdef"


async def timed(coro, timeout_s: float = 600.0) -> tuple[object, float]:
    """(the answer or the exception, seconds); past `timeout_s` the exception is a TimeoutError."""
    t0 = time.monotonic()
    try:
        got = await asyncio.wait_for(coro, timeout_s)
    except (Exception, asyncio.TimeoutError) as err:  # noqa: BLE001 - sorted by the caller
        got = err
    return got, time.monotonic() - t0


def http_body(tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": tokens}


async def polite_pair(addr: str, web: httpx.AsyncClient, tokens: int, timeout_s: float) -> tuple[tuple, tuple]:
    """One polite request over each channel: ((answer, s) over ZeroMQ, (response, s) over HTTP)."""
    async with AsyncClient(addr, timeout_s=timeout_s) as polite:
        zmq = await timed(polite.generate(PROMPT, max_new_tokens=tokens), timeout_s)
    http = await timed(web.post("/v1/chat/completions", json=http_body(tokens),
                                headers={"Authorization": f"Bearer {POLITE_KEY}"}), timeout_s)
    return zmq, http


async def flood_then_polite(addr: str, base: str, args) -> dict:
    limits = httpx.Limits(max_connections=args.flood + 16, max_keepalive_connections=args.flood + 16)
    wait_s = args.timeout
    async with httpx.AsyncClient(base_url=base, timeout=wait_s, limits=limits) as web:
        idle = [await polite_pair(addr, web, args.polite_tokens, wait_s) for _ in range(3)]
        async with AsyncClient(addr, timeout_s=wait_s) as flood:
            zmq_tasks = [asyncio.create_task(timed(flood.generate(PROMPT, max_new_tokens=args.flood_tokens), wait_s))
                         for _ in range(args.flood)]
            http_tasks = [asyncio.create_task(timed(web.post(
                "/v1/chat/completions", json=http_body(args.flood_tokens),
                headers={"Authorization": f"Bearer {FLOOD_KEY}"}), wait_s)) for _ in range(args.flood)]
            queue_full = await refused(zmq_tasks, http_tasks, wait_s)
            during = await polite_pair(addr, web, args.polite_tokens, wait_s)
            zmq_flood, http_flood = await asyncio.gather(*zmq_tasks), await asyncio.gather(*http_tasks)
    fig = summary(idle, during, zmq_flood, http_flood) | {"queue_full_before_polite": queue_full}
    fig["ok"] = fig["ok"] and queue_full
    return fig


async def refused(zmq_tasks: list, http_tasks: list, timeout_s: float, settle_s: float = 2.0) -> bool:
    """Until each flood has had requests refused and no more for `settle_s` (the refusals come as the
    flood arrives, past the cap): then the head holds the flood's full queue. False if that did not
    happen within `timeout_s` (a flood smaller than the cap, or one that never got in)."""
    def count() -> tuple[int, int]:
        return (sum(t.done() and not answered("zmq", t.result()[0]) for t in zmq_tasks),
                sum(t.done() and not answered("http", t.result()[0]) for t in http_tasks))

    give_up, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < give_up:
        now, seen = time.monotonic(), count()
        if seen != last:
            last, since = seen, now
        elif min(seen) > 0 and now - since >= settle_s:
            return True
        await asyncio.sleep(0.05)
    return False


def answered(channel: str, got) -> bool:
    return (not isinstance(got, BaseException)) if channel == "zmq" else \
        isinstance(got, httpx.Response) and got.status_code == 200


def tokens_of(channel: str, got):
    """(token count, what is compared with the idle answer), or None for a non-answer."""
    if not answered(channel, got):
        return None
    if channel == "zmq":
        return len(got.token_ids), list(got.token_ids)
    body = got.json()
    return body["usage"]["completion_tokens"], body["choices"][0]["message"]


def summary(idle: list, during: tuple, zmq_flood: list, http_flood: list) -> dict:
    zmq_ok = [a for a, _ in zmq_flood if answered("zmq", a)]
    running_s = max((a.stats.wall_s for a in zmq_ok), default=0.0)   # a flood request's run, start to end
    out = {"running_request_s": round(running_s, 3)}
    for i, channel in enumerate(("zmq", "http")):
        idle_s = statistics.median(p[i][1] for p in idle)
        got, polite_s = during[i]
        mine, reference = tokens_of(channel, got), tokens_of(channel, idle[0][i][0])
        bound_s = 2 * idle_s + running_s
        out[channel] = {"idle_s": round(idle_s, 3), "polite_s": round(polite_s, 3), "bound_s": round(bound_s, 3),
                        "answered": mine is not None, "tokens": mine[0] if mine else None,
                        "same_as_idle": mine is not None and reference is not None and mine[1] == reference[1],
                        "within_bound": mine is not None and polite_s <= bound_s}
        if mine is None:
            out[channel]["error"] = outcome_key(got)
    out["zmq"]["flood"] = outcome_counts([a for a, _ in zmq_flood])
    out["http"]["flood"] = outcome_counts([r for r, _ in http_flood])
    out["ok"] = all(out[c]["within_bound"] and out[c]["same_as_idle"] for c in ("zmq", "http"))
    return out


def outcome_key(r) -> str:
    """"answered", an HTTP status, or the error's name (TimeoutError: no answer in time)."""
    if isinstance(r, httpx.Response):
        return "answered" if r.status_code == 200 else str(r.status_code)
    return type(r).__name__ if isinstance(r, BaseException) else "answered"


def outcome_counts(results: list) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[outcome_key(r)] = counts.get(outcome_key(r), 0) + 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=400, help="flood requests on each channel")
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--polite-tokens", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any one request may take")
    ap.add_argument("--deadline", type=float, default=1800.0, help="seconds the whole drill may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    home = Path(tempfile.mkdtemp(prefix="flowedge-fairness-"))
    os.environ["FLOWEDGE_HOME"] = str(home)
    start_args = soak.ClusterOptions(nodes=args.nodes,
                                     http_args=["--api-key", FLOOD_KEY, "--api-key", POLITE_KEY,
                                                "--max-requests-per-s", "0",
                                                "--max-connections", str(2 * args.flood + 64)])
    procs = soak.start(start_args, home)
    try:
        fig = asyncio.run(asyncio.wait_for(flood_then_polite(procs.cluster.spec.addr, procs.base, args),
                                           args.deadline))
    finally:
        procs.http.send_signal(signal.SIGTERM)
        procs.http.wait(20)
        procs.cluster.stop(grace_s=5.0)
    print(json.dumps(fig, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")
    raise SystemExit(0 if fig["ok"] else 1)


if __name__ == "__main__":
    main()
