"""The dashboard (flowedge/api/dashboard.py and api/static/): its routes, auth and security headers without
a cluster; the page in a real headless Chromium fed a status the test writes: markup in what peers report
is shown as text and runs nothing, values of the wrong type still draw the cluster, `?ask=` fills the box
but sends only on a click, and the API key lives in the tab's sessionStorage; then against a real tiny
3-node cluster: it loads, shows the three nodes, and moves (tokens/s, running requests) while an answer
streams through its own chat box."""
from __future__ import annotations

import asyncio
import copy
import os
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from browser_helpers import Page, why_not
from cluster_helpers import READY_TIMEOUT_S, flowedge_home, free_port_pair, logs
from flowedge.api import dashboard
from flowedge.api.app import create_app
from flowedge.api.headers import CONTENT_SECURITY_POLICY
from flowedge.api.server import build_server
from flowedge.api.settings import ApiSettings
from flowedge.client.sync_client import wait_ready
from flowedge.errors import FlowedgeError
from flowedge.launch import local_cluster
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.node.timeline import Timeline, sample

KEY = "test-key-0123456789abcdef"
# where the screenshots go: a temporary folder, or docs/ with FLOWEDGE_DASHBOARD_SHOTS=docs (how the
# committed docs/dashboard-*.png were made), so the suite does not rewrite tracked files
SHOTS_ENV = "FLOWEDGE_DASHBOARD_SHOTS"
BODY = "JSON.stringify(document.body.dataset)"


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
    assert keyed.get(dashboard.TIMELINE_PATH).status_code == 401


def test_an_older_head_has_no_past_and_the_endpoint_says_so():
    assert dashboard.timeline_of({"role": "head"})["samples"] == []
    past = {"every_s": 1.0, "fields": ["t"], "samples": [[1.0]]}
    assert dashboard.timeline_of({"role": "head", "timeline": past}) == past


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


def test_every_response_carries_the_security_headers(keyed):
    for path, status in (("/", 200), ("/dashboard/dashboard.js", 200), ("/v1/status", 401),
                         ("/dashboard/nosuch.js", 404)):
        r = keyed.get(path)
        assert r.status_code == status, path
        assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, path
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff", path
    csp = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert csp["script-src"] == "'self'" and csp["frame-ancestors"] == "'none'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY


def test_the_page_holds_no_inline_script_and_turns_no_data_into_html():
    page = (dashboard.STATIC_DIR / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page) and not re.search(r"\son[a-z]+=", page)
    for name in ("dashboard.js", "timeline.js"):
        script = (dashboard.STATIC_DIR / name).read_text()
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|localStorage\.setItem", script)


def test_static_files_ship_in_the_package():
    setup = (Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    assert "api/static/*" in setup
    assert {p.name for p in dashboard.STATIC_DIR.iterdir()} >= {"index.html", "dashboard.js", "timeline.js",
                                                                 "dashboard.css"}


# ---- the page in a real headless Chromium, fed a status the test writes ------------------------------
XSS = "<img src=x onerror=\"document.body.dataset.pwned='yes'\">"
PWNED = "document.body.dataset.pwned"


def head_row(**extra) -> dict:
    return {"node_id": "head", "role": "head", "stage": 0, "ready": True, "model": "tiny", "strategy": "flowspec",
            "layers": "embed+head", "load": 0.1, "last_seen_s": 0.0, "served": {"requests": 0, "tokens": 0}} | extra


def stage_row(k: int, **extra) -> dict:
    return {"node_id": f"s{k}", "role": "stage", "stage": k, "ready": True, "layers": [2 * k - 2, 2 * k],
            "device": "orin-nano-8gb", "address": f"tcp://10.0.0.{k}:6000", "load": 0.5, "rss_bytes": 1e8,
            "free_memory_bytes": 4e9, "last_seen_s": 0.2, "step_ms_median": 12.5} | extra


@pytest.fixture(scope="module")
def fed():
    """`flowedge http` with API keys whose head status is what the test puts in `feed["nodes"]` (no head:
    the page must hold up whatever a node's row carries, whether or not the head checked it); `asked`
    lists the paths of the requests it got."""
    if why_not():
        pytest.skip(why_not())
    feed: dict = {"nodes": [head_row(), stage_row(1), stage_row(2)]}
    asked: list[str] = []

    async def status(timeline: bool = False):
        nodes = copy.deepcopy(feed["nodes"])
        if nodes and timeline and "timeline" in feed:
            nodes[0]["timeline"] = feed["timeline"]
        return nodes

    server = build_server(ApiSettings(head="127.0.0.1:1", api_keys=(KEY,), insecure=True, request_timeout_s=2.0,
                                      status_timeout_s=0.5), "127.0.0.1", 0, log_level="warning")
    app = server.config.app
    app.state.routes.head_status = status   # the one part played by the test: the head

    async def recording(scope, receive, send):
        if scope["type"] == "http":
            asked.append(scope["path"])
        await app(scope, receive, send)

    server.config.app = recording
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield {"url": f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", "feed": feed,
               "asked": asked}
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture()
def page(fed, tmp_path):
    b = Page()
    yield b
    b.close()


def open_with_key(browser: Page, url: str, updates: int = 4) -> None:
    """Open the page, give it the key as a user does (the form it shows on 401), wait for `updates` statuses."""
    browser.open(url)
    assert browser.wait_for("document.getElementById('keyform') && !document.getElementById('keyform').hidden", 20)
    browser.eval(f"document.getElementById('key').value = {json.dumps(KEY)}; "
                 "document.getElementById('keyform').requestSubmit()")
    assert browser.wait_for(f"Number(document.body.dataset.updates || 0) >= {updates}", 30), browser.eval(BODY)


def test_markup_in_a_node_s_row_is_shown_as_text_and_runs_nothing(fed, page):
    """A peer's heartbeat stats were merged into its row and the page put `stage` and `step_ms_median` into
    HTML: two injected handlers ran. Every field here carries markup; the page draws it as text."""
    fed["feed"]["nodes"] = [head_row(), stage_row(1, stage=XSS, step_ms_median=XSS, node_id=XSS, device=XSS,
                                                  address=XSS, error=XSS, layers=XSS), stage_row(2, dropped={XSS: 1})]
    try:
        open_with_key(page, fed["url"] + "/")
        fed["feed"]["nodes"][2]["dropped"] = {XSS: 2}   # a drop: the events list quotes the rule names
        assert page.wait_for("document.getElementById('events').textContent.includes('dropped 1')", 10)
        time.sleep(1.0)   # time for a broken image to fire its handler, had one been made
        assert page.eval(PWNED) is None
        assert page.eval("document.querySelectorAll('main img').length") == 0
        assert page.eval("document.getElementById('pipeline').textContent.split('<img src=x').length - 1") >= 5
        assert page.eval("document.querySelectorAll('.node').length") == 3
        # and markup that did reach the page would still run nothing: the policy allows no inline handler
        page.eval(f"document.getElementById('events').insertAdjacentHTML('beforeend', {json.dumps(XSS)})")
        time.sleep(1.0)
        assert page.eval(PWNED) is None and page.eval("document.querySelectorAll('#events img').length") == 1
    finally:
        fed["feed"]["nodes"] = [head_row(), stage_row(1), stage_row(2)]


def test_values_of_the_wrong_type_still_draw_the_cluster(fed, page):
    """A string `last_seen_s` threw while drawing, and the page drew no cluster at all."""
    fed["feed"]["nodes"] = [head_row(), stage_row(1, last_seen_s="soon", load="x", rss_bytes="y", stage={"a": 1},
                                                  layers=["a", None], wire="zzz", dropped="many", node_id=7),
                            stage_row(2, last_seen_s=None, step_ms_median=[1], wire={"segment": None})]
    try:
        open_with_key(page, fed["url"] + "/")
        assert page.eval("document.querySelectorAll('.node').length") == 3
        assert page.eval("document.body.dataset.nodes") == "3"
        cards = page.eval("document.getElementById('pipeline').innerText")
        assert "stage 2" in cards and "heartbeat" in cards and "layers 2–3" in cards
        assert page.eval("document.getElementById('conn').textContent") == "serving"
    finally:
        fed["feed"]["nodes"] = [head_row(), stage_row(1), stage_row(2)]


def test_the_queue_by_client_is_a_table_of_text(fed, page):
    """The head's fair queue, one row per client (engine/fair_queue.py); a client's name is whatever a
    gateway sent, so it is drawn as text; no clients (or no list), no table."""
    rows = [{"client": XSS, "weight": 1.0, "queued": 3, "running": 1, "refused": 5},
            {"client": "http:key-0123456789ab", "weight": 2, "queued": "x", "running": None, "refused": 0}]
    fed["feed"]["nodes"] = [head_row(clients=rows), stage_row(1), stage_row(2)]
    try:
        open_with_key(page, fed["url"] + "/")
        assert page.eval("document.body.dataset.clients") == "2"
        assert not page.eval("document.getElementById('clients-box').hidden")
        table = page.eval("document.getElementById('clients').innerText")
        assert "http:key-0123456789ab\t2\t-\t-\t0" in table and "<img src=x" in table and "\t3\t1\t5" in table
        assert page.eval("document.querySelectorAll('main img').length") == 0 and page.eval(PWNED) is None
        fed["feed"]["nodes"][0]["clients"] = "many"
        assert page.wait_for("document.body.dataset.clients === '0'", 10)
        assert page.eval("document.getElementById('clients-box').hidden")
    finally:
        fed["feed"]["nodes"] = [head_row(), stage_row(1), stage_row(2)]


def test_the_head_card_shows_its_term_and_the_standby_that_follows_it(fed, page):
    """The head's fencing term and its standby heads (node/standby_status.py), as text on the head's card."""
    standby = {"node_id": "standby-1", "address": "10.0.0.9:5555", "last_seen_s": 0.04, "log_sent_tokens": 40,
               "log_applied_tokens": 37, "log_behind_tokens": 3, "state_age_s": 0.05}
    fed["feed"]["nodes"] = [head_row(term=2, standbys=[standby, None]), stage_row(1), stage_row(2)]
    try:
        open_with_key(page, fed["url"] + "/")
        head = page.eval("document.querySelector('[data-node=\"0\"]').innerText")
        assert "term\n2" in head and "standby-1 at 10.0.0.9:5555, log 3 tokens behind, heard 0.0 s ago" in head, head
    finally:
        fed["feed"]["nodes"] = [head_row(), stage_row(1), stage_row(2)]


def test_ask_fills_the_box_and_sends_only_on_a_click_with_the_key_kept_for_the_tab(fed, page):
    """`/?ask=` sent its question on load with the stored key: a link could spend it unseen."""
    def chats() -> int:
        return sum(path == "/v1/chat/completions" for path in fed["asked"])

    before = chats()
    open_with_key(page, fed["url"] + "/?ask=what%20is%20it&max=7")
    assert page.eval("document.getElementById('prompt').value") == "what is it"
    assert page.eval("document.getElementById('maxtok').value") == "7"
    assert chats() == before and page.eval("document.getElementById('answer').textContent") == ""
    assert page.eval("sessionStorage.getItem('flowedge-key')") == KEY
    assert page.eval("localStorage.getItem('flowedge-key')") is None
    page.eval("document.getElementById('send').click()")
    deadline = time.monotonic() + 20
    while chats() == before and time.monotonic() < deadline:   # the click sends it (with no head behind
        time.sleep(0.1)                                         # this server it then fails, as it may)
    assert chats() == before + 1


def shown(page: Page, element: str) -> bool:
    return page.eval(f"document.getElementById('{element}').offsetParent !== null")


def test_before_the_first_status_the_page_says_what_it_waits_for(fed, page):
    """Before the first status the page drew an empty cluster and a blank canvas as wide as the screen."""
    feed = fed["feed"]
    try:
        page.open(fed["url"] + "/")
        assert page.wait_for("!document.getElementById('keyform').hidden", 20)
        assert "API key" in page.eval("document.getElementById('waittitle').textContent")
        assert shown(page, "waiting") and not shown(page, "live") and not shown(page, "timeline")
        feed["nodes"] = None   # `flowedge http` answers, its head does not
        page.eval(f"document.getElementById('key').value = {json.dumps(KEY)}; "
                  "document.getElementById('keyform').requestSubmit()")
        assert page.wait_for("Number(document.body.dataset.updates || 0) >= 2", 20), page.eval(BODY)
        assert page.eval("document.getElementById('waittitle').textContent") == "The head does not answer"
        assert shown(page, "waiting") and not shown(page, "live")
        feed["nodes"] = [head_row(), stage_row(1), stage_row(2)]
        assert page.wait_for("document.getElementById('waiting').hidden", 20)
        assert shown(page, "live") and shown(page, "timeline")
        assert page.eval("document.getElementById('timeline').height") < 300   # sized to its rows
    finally:
        feed["nodes"] = [head_row(), stage_row(1), stage_row(2)]


def late_past(now: float, seconds: int) -> dict:
    """What a head that has been up `seconds` keeps: stage 2's slot empty throughout."""
    t = Timeline()
    for i in range(seconds):
        live = {"queued": i % 3, "running": 1, "tokens_per_s": 5.0 + i % 7}
        rows = [stage_row(1, kv_tokens=100 + i, stage=1), {"role": "stage", "stage": 2, "missing": True}]
        t.add(sample(now - seconds + i, live, 0.2, rows), float(i))
    return t.snapshot()


def test_a_page_opened_late_draws_the_head_s_past_and_what_runs_now(fed, page):
    """The timeline lived in the browser: a page opened late drew nothing of what came before it."""
    feed, now = fed["feed"], time.time()
    requests = {"queued": 2, "running": 1, "tokens_per_s": 4.5, "active": [
        {"id": 3, "state": "running", "tokens": 40, "elapsed_s": 8.0, "tokens_per_s": 5.0, "client": XSS,
         "mean_accept_len": 2.5}]}
    feed["nodes"] = [head_row(version="0.1.0", uptime_s=7300, kv_reserved_tokens=640, requests=requests),
                     stage_row(1, kv_tokens=250, kv_budget_tokens=1000), stage_row(2)]
    feed["timeline"] = late_past(now, 300)
    try:
        open_with_key(page, fed["url"] + "/")
        assert page.wait_for("document.body.dataset.past", 20) == "300"
        assert float(page.eval("document.body.dataset.pastFrom")) < now - 290
        page.eval("const s = document.getElementById('spansel'); s.value = '600'; s.dispatchEvent(new Event('change'))")
        # the head's row, 4 min ago (in its past) is drawn; 7.5 min ago (before the head was up) is not
        painted = ("(() => { const c = document.getElementById('timeline'), x = 70 + (c.width - 70) * %s; "
                   "return c.getContext('2d').getImageData(x, 12, 1, 1).data[3]; })()")
        assert page.eval(painted % 0.6) > 0 and page.eval(painted % 0.25) == 0
        table = page.eval("document.getElementById('requests').textContent")
        assert "<img src=x" in table and "running" in table and "5.0" in table and "2.50" in table
        assert page.eval("document.querySelectorAll('#requests img').length") == 0 and page.eval(PWNED) is None
        assert page.eval("document.getElementById('reqnote').textContent") == "2 more queued"
        cards = page.eval("document.getElementById('pipeline').innerText")
        assert "250 / 1000 tokens" in cards and "640 tokens" in cards
        assert page.eval("document.querySelectorAll('.node .bar.kv').length") == 1
        assert page.eval("document.getElementById('about').textContent") == "flowedge 0.1.0 · up 2 h 1 min"
        assert "busy fraction" in page.eval("document.getElementById('legend').innerText")
    finally:
        feed.pop("timeline", None)
        feed["nodes"] = [head_row(), stage_row(1), stage_row(2)]


# ---- the page in a real headless Chromium against a real cluster ----------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    if why_not():
        pytest.skip(why_not())
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
    b = Page()
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
    """The page's own chat box asks (?ask= and a click); while the answer streams, tokens/s and `running` move, which
    they only can because the head counts tokens as they are sent (not when the answer ends)."""
    browser.open(stack["url"] + "/?ask=1%202%203%204&max=1500")   # long enough to be seen moving on a loaded box
    assert browser.wait_for("Number(document.body.dataset.updates || 0) >= 1", 30), browser.eval(BODY)
    browser.eval("document.getElementById('send').click()")   # ?ask= fills the box; a click sends it
    # the page saw tokens/s > 0 with the request running before the answer ended (marked by the page itself:
    # on a loaded box the answer can end between this test's polls)
    assert browser.wait_for("document.body.dataset.movedWhileAnswering", 60), browser.eval(BODY)
    assert browser.eval("Number(document.body.dataset.maxRunning)") >= 1
    assert browser.wait_for("document.getElementById('requests').textContent.includes('http:addr-127.0.0.1')", 10)
    browser.eval("window.scrollTo(0, 0)")   # the picture while it runs (the tiny model's answers are short)
    browser.screenshot(shots / "dashboard-answering.png")
    assert browser.wait_for("document.body.dataset.answered", 120), browser.eval(BODY)
    answer = browser.eval("document.getElementById('answer').textContent")
    assert answer.strip() and "[error" not in answer, answer
    with httpx.Client(timeout=30) as http:
        assert http.get(stack["url"] + "/v1/status").json()["nodes"][0]["served"]["tokens"] > 0


def test_a_page_opened_late_sees_the_head_s_past(stack, browser, shots):
    """The head keeps its last minutes (one sample a second) and the page draws them when it opens, along
    with each stage's KV use against its budget and the head's version and uptime."""
    with httpx.Client(timeout=30) as http:
        deadline = time.monotonic() + 30
        while len(http.get(stack["url"] + dashboard.TIMELINE_PATH).json()["samples"]) < 5:
            assert time.monotonic() < deadline, "the head keeps no timeline"
            time.sleep(0.5)
        opened = time.time()
        past = http.get(stack["url"] + dashboard.TIMELINE_PATH).json()
        nodes = http.get(stack["url"] + "/v1/status").json()["nodes"]
    first = past["samples"][0]
    assert first[past["fields"].index("t")] < opened - 3
    assert [s[0] for s in first[past["fields"].index("stages")]] == [1, 2]
    assert nodes[0]["version"] and nodes[0]["uptime_s"] > 0 and "timeline" not in nodes[0]
    assert all(n["kv_budget_tokens"] > 0 and n["kv_tokens"] >= 0 for n in nodes[1:3])
    browser.open(stack["url"] + "/")
    assert browser.wait_for("Number(document.body.dataset.past || 0) >= 5", 30), browser.eval(BODY)
    assert float(browser.eval("document.body.dataset.pastFrom")) < opened - 3
    assert "KV cache" in browser.eval("document.getElementById('pipeline').innerText")
    assert browser.eval("document.getElementById('about').textContent").startswith("flowedge ")
    browser.screenshot(shots / "dashboard-late.png")
