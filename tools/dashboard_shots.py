"""Screenshots of the dashboard on a real local cluster, for docs/: idle with history, answering, and a
stage killed. Starts a cluster (`flowedge up`'s launcher, default the real pair on 3 nodes) and the HTTP
front in this process, drives Debian's chromium with playwright-python, and stops everything at the end.

    python tools/dashboard_shots.py                      # real pair -> docs/dashboard-real-*.png
    python tools/dashboard_shots.py --model DIR --draft DIR --out /tmp/shots --history-s 10
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx

from flowedge.api.server import build_server
from flowedge.api.settings import ApiSettings
from flowedge.client.sync_client import wait_ready
from flowedge.launch import local_cluster
from flowedge.launch.local_cluster import LocalCluster, LocalClusterSpec

log = logging.getLogger("dashboard_shots")
DOCS = Path(__file__).resolve().parents[1] / "docs"
PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


class Shooter:
    """One headless chromium tab on the dashboard (`executable_path`: no browser download)."""

    def __init__(self, url: str, out: Path, prefix: str) -> None:
        from playwright.sync_api import sync_playwright

        self.url, self.out, self.prefix = url, out, prefix
        self._pw = sync_playwright().start()
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        self._browser = self._pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        self.page = self._browser.new_page(viewport={"width": 1280, "height": 1000})

    def wait(self, expression: str, timeout_s: float) -> None:
        # a function, not a string: the page's CSP forbids the eval a string predicate needs
        self.page.wait_for_function(f"() => ({expression})", timeout=timeout_s * 1000, polling=200)

    def shot(self, name: str) -> Path:
        path = self.out / f"{self.prefix}-{name}.png"
        self.page.evaluate("window.scrollTo(0, 0)")
        self.page.screenshot(path=str(path))
        log.info("wrote %s", path)
        return path

    def close(self) -> None:
        self._browser.close()
        self._pw.stop()


def idle_with_history(s: Shooter, url: str, history_s: float) -> None:
    """One short answer first, then `history_s` of idling, so the timeline has a past to draw."""
    with httpx.Client(timeout=600) as http:
        http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hello."}],
                                                       "max_tokens": 24}).raise_for_status()
    time.sleep(history_s)
    s.page.goto(url + "/")
    s.wait("Number(document.body.dataset.past || 0) >= 5 && Number(document.body.dataset.updates || 0) >= 4", 60)
    s.shot("idle")


def answering(s: Shooter, url: str, max_tokens: int) -> None:
    s.page.goto(url + f"/?ask={quote(PROMPT)}&max={max_tokens}")
    s.wait("Number(document.body.dataset.updates || 0) >= 1", 60)
    s.page.evaluate("document.getElementById('send').click()")
    s.wait("Number(document.body.dataset.maxTps || 0) > 0", 300)
    time.sleep(3.0)   # a few seconds of tok/s on the timeline
    s.shot("answering")
    s.wait("document.body.dataset.answered", 600)


def stage_killed(s: Shooter, cluster: LocalCluster, stage: int) -> None:
    os.kill(cluster.procs[stage].pid, signal.SIGKILL)
    log.info("killed stage %d (pid %d)", stage, cluster.procs[stage].pid)
    s.wait("document.querySelectorAll('.node.missing').length >= 1", 60)
    time.sleep(1.0)
    s.shot("stage-killed")


def serve_http(addr: str):
    server = build_server(ApiSettings(head=addr, request_timeout_s=600), "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--port", type=int, default=7450)
    ap.add_argument("--out", type=Path, default=DOCS)
    ap.add_argument("--prefix", default="dashboard-real")
    ap.add_argument("--history-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = LocalClusterSpec(nodes=args.nodes, model=args.model, draft=args.draft, port=args.port)
    cluster = local_cluster.start(spec)
    server = thread = shooter = None
    try:
        wait_ready(spec.addr, 1800, alive=cluster.alive)
        server, thread, url = serve_http(spec.addr)
        shooter = Shooter(url, args.out, args.prefix)
        idle_with_history(shooter, url, args.history_s)
        answering(shooter, url, args.max_tokens)
        stage_killed(shooter, cluster, args.nodes - 1)
    finally:
        if shooter is not None:
            shooter.close()
        if server is not None:
            server.should_exit = True
            thread.join(10)
        cluster.stop()


if __name__ == "__main__":
    main()
