"""A slowloris against `flowedge http` alone, no cluster: the HTTP front in its own process (its head status
played: always ready), attacker processes opening --connections sockets each from 127.0.0.2 (or one address
each with --spread) and dribbling a header byte into every one each --dribble s, reopening what the server
closes; one legitimate client from 127.0.0.1 asks /health every --every s for --duration s. Prints what it
was answered (tools/slowloris.py runs the same kind of attack against a whole tiny cluster).

    python tools/slowloris_health.py --connections 500 --dribble 0.05 --duration 60
    python tools/slowloris_health.py --attackers 3 --keep-alive
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import time

import httpx


def serve(port: int) -> None:
    from flowedge.api.server import build_server
    from flowedge.api.settings import ApiSettings

    server = build_server(ApiSettings(head="127.0.0.1:1", insecure=True), "127.0.0.1", port, log_level="error")

    async def ready() -> list[dict]:
        return [{"node_id": "head", "role": "head", "ready": True}]

    server.config.app.state.routes.head_status = ready
    server.run()


def attack(port: int, source: str, n: int, dribble_s: float, duration_s: float, opened: mp.Queue) -> None:
    socks: list[socket.socket | None] = [None] * n
    count, stop = 0, time.monotonic() + duration_s
    while time.monotonic() < stop:
        for i, s in enumerate(socks):
            try:
                if s is None:
                    s = socks[i] = socket.socket()
                    s.settimeout(1.0)
                    s.bind((source, 0))
                    s.connect(("127.0.0.1", port))
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    count += 1
                s.sendall(b"X")
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = None
        time.sleep(dribble_s)
    opened.put(count)


def legitimate(url: str, duration_s: float, every_s: float, keep_alive: bool) -> dict:
    asked, answers, waits = 0, {}, []
    client = httpx.Client(timeout=10) if keep_alive else None
    stop = time.monotonic() + duration_s
    while time.monotonic() < stop:
        asked += 1
        t0 = time.monotonic()
        try:
            what = str((client.get(url) if client else httpx.get(url, timeout=10)).status_code)
        except httpx.HTTPError as err:
            what = type(err).__name__
        waits.append(time.monotonic() - t0)
        answers[what] = answers.get(what, 0) + 1
        time.sleep(every_s)
    waits.sort()
    return {"asked": asked, "answers": answers, "served_fraction": round(answers.get("200", 0) / asked, 4),
            "p50_s": round(waits[len(waits) // 2], 3), "max_s": round(waits[-1], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=200, help="sockets per attacker process")
    ap.add_argument("--attackers", type=int, default=1)
    ap.add_argument("--spread", action="store_true", help="one source address per attacker (127.0.0.2, .3, ...)")
    ap.add_argument("--dribble", type=float, default=0.1, help="seconds between passes over the sockets")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--every", type=float, default=0.2, help="seconds between the legitimate client's requests")
    ap.add_argument("--keep-alive", action="store_true", help="the legitimate client keeps its connection")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/health"
    server = mp.Process(target=serve, args=(port,), daemon=True)
    server.start()
    for _ in range(150):
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    opened: mp.Queue = mp.Queue()
    attackers = [mp.Process(target=attack, daemon=True, args=(
        port, f"127.0.0.{2 + k if args.spread else 2}", args.connections, args.dribble, args.duration + 3, opened))
        for k in range(args.attackers)]
    for a in attackers:
        a.start()
    time.sleep(3.0)   # the slow connections are in place first
    result = legitimate(url, args.duration, args.every, args.keep_alive)
    result["slow_opened"] = sum(opened.get(timeout=30) for _ in attackers)
    server.terminate()
    print(json.dumps(vars(args) | result))


if __name__ == "__main__":
    main()
