"""The dashboard (flowedge/api/dashboard.py and api/static/): its routes and auth without a cluster, then
the page in a real headless Chromium against a real tiny 3-node cluster: it loads, shows the three
nodes, and moves (tokens/s, running requests) while an answer streams through its own chat box."""
from __future__ import annotations

import asyncio
import os
import json
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from cdp_helpers import Browser
from daemon_helpers import READY_TIMEOUT_S, flowedge_home, free_port_pair, logs
from flowedge.api import dashboard
from flowedge.api.app import create_app
from flowedge.api.server import build_server
from flowedge.api.settings import ApiSettings
from flowedge.daemon import local_cluster
from flowedge.daemon.client import wait_ready
from flowedge.daemon.local_cluster import LocalClusterSpec
from flowedge.errors import FlowedgeError

KEY = "test-key-0123456789abcdef"
# where the screenshots go: a temporary folder, or docs/ with FLOWEDGE_DASHBOARD_SHOTS=docs (how the
# committed docs/dashboard-*.png were made), so the suite does not rewrite tracked files
SHOTS_ENV = "FLOWEDGE_DASHBOARD_SHOTS"
BODY = "JSON.stringify(document.body.dataset)"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


# ---- routes and auth, no cluster -------------------------------------------------------------------
@pytest.fixture()
def keyed():
    return TestClient(create_app(ApiSettings(head="tcp://127.0.0.1:1", api_keys=(KEY,), status_timeout_s=0.2)))


def test_page_and_files_are_served_without_a_key(keyed):
    page = keyed.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in re.findall(r'(?:src|href)="(/dashboard/[^"]+)"', page.text):
        r = keyed.get(src)
        assert r.status_code == 200 and len(r.content) > 500, src
    assert keyed.get("/dashboard/nosuch.js").status_code == 404


def test_the_data_needs_the_key(keyed):
    assert keyed.get(dashboard.STREAM_PATH).status_code == 401
    assert keyed.get("/v1/status").status_code == 401


def test_open_paths_are_only_the_page_and_its_files():
    assert dashboard.is_open("/") and dashboard.is_open("/dashboard/dashboard.js")
    assert not dashboard.is_open(dashboard.STREAM_PATH) and not dashboard.is_open("/v1/chat/completions")
    assert not dashboard.is_open("/dashboardx")


def test_status_events_say_null_while_the_head_is_silent():
    answers = iter([None, [{"role": "head"}]])

    async def fetch():
        return next(answers)

    async def two():
        events = dashboard.status_events(fetch, interval_s=0.01)
        got = [await anext(events), await anext(events)]
        await events.aclose()
        return got

    first, second = asyncio.run(two())
    assert json.loads(first.removeprefix(b"data: "))["nodes"] is None
    assert json.loads(second.removeprefix(b"data: "))["nodes"] == [{"role": "head"}]


def test_static_files_ship_in_the_package():
    setup = (Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    assert "api/static/*" in setup
    assert {p.name for p in dashboard.STATIC_DIR.iterdir()} >= {"index.html", "dashboard.js", "dashboard.css"}


# ---- the page in a real headless Chromium ----------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no Chromium (apt-get install chromium; `make test` installs it where it can)")
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                device="orin-nano-8gb")
        cluster = local_cluster.start(spec)
        server = build_server(ApiSettings(head=spec.addr, request_timeout_s=120), "127.0.0.1", 0,
                              log_level="warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                time.sleep(0.05)
            try:
                wait_ready(spec.addr, READY_TIMEOUT_S, alive=cluster.alive)
            except FlowedgeError as err:
                raise AssertionError(f"cluster did not start: {err}\n{logs(cluster.run_dir)}") from None
            yield {"url": f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", "cluster": cluster}
        finally:
            server.should_exit = True
            thread.join(10)
            cluster.stop()


@pytest.fixture()
def shots(tmp_path) -> Path:
    where = os.environ.get(SHOTS_ENV)
    return Path(__file__).resolve().parents[1] / "docs" if where == "docs" else Path(where or tmp_path)


@pytest.fixture()
def browser(stack, tmp_path):
    b = Browser(CHROMIUM, tmp_path / "profile")
    yield b
    b.close()


def test_idle_page_shows_the_three_nodes(stack, browser, shots):
    browser.open(stack["url"] + "/")
    assert browser.wait_for("Number(document.body.dataset.updates || 0) >= 12", 30), browser.eval(BODY)
    assert browser.eval("document.querySelectorAll('.node.ready').length") == 3
    cards = browser.eval("document.getElementById('pipeline').innerText")
    assert "stage 1" in cards and "stage 2" in cards and "layers 0–" in cards and "heartbeat" in cards
    assert browser.eval("document.getElementById('conn').textContent") == "serving"
    browser.screenshot(shots / "dashboard-idle.png")
    assert (shots / "dashboard-idle.png").stat().st_size > 10_000


def test_page_moves_while_an_answer_streams(stack, browser, shots):
    """The page's own chat box asks (?ask=); while the answer streams, tokens/s and `running` move, which
    they only can because the head counts tokens as they are sent (not when the answer ends)."""
    browser.open(stack["url"] + "/?ask=1%202%203%204&max=1500")   # long enough to be seen moving on a loaded box
    assert browser.wait_for("Number(document.body.dataset.maxTps || 0) > 0", 60), browser.eval(BODY)
    assert browser.eval("document.body.dataset.answered") is None   # it moved before the answer ended
    assert browser.eval("Number(document.body.dataset.maxRunning)") >= 1
    assert browser.eval("document.getElementById('running').textContent") == "1"
    time.sleep(3)   # a few seconds of timeline for the picture
    browser.screenshot(shots / "dashboard-answering.png")
    assert browser.wait_for("document.body.dataset.answered", 120), browser.eval(BODY)
    answer = browser.eval("document.getElementById('answer').textContent")
    assert answer.strip() and "[error" not in answer, answer
    with httpx.Client(timeout=30) as http:
        assert http.get(stack["url"] + "/v1/status").json()["nodes"][0]["served"]["tokens"] > 0
