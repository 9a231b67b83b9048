"""The HTTP API's parts without a cluster: stop strings, prompt building, API keys, request bodies."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api_helpers import closed_after_s, serving

from flowedge.api.app import create_app
from flowedge.api.settings import ApiSettings, check_exposure, load_api_keys
from flowedge.errors import ConfigError
from flowedge.text.prompts import PromptError, chat_ids, prompt_ids
from flowedge.text.streams import StopText
from flowedge.transport import protocol as proto

KEY = "k" * 24


def _feed(stops, pieces):
    cut = StopText(stops)
    return "".join(cut.feed(p) for p in pieces) + cut.finish(), cut.hit


@pytest.mark.parametrize("stops,pieces,want,hit", [
    ([], ["ab", "cd"], "abcd", False),
    (["cd"], ["ab", "cd", "ef"], "ab", True),
    (["cd"], ["abc", "def"], "ab", True),              # the stop string spans two pieces
    (["xyz"], ["abx", "y"], "abxy", False),            # a held-back prefix is released at the end
    (["END", "b"], ["aEN", "Db"], "a", True),          # the earliest stop wins
    (["\n\n"], ["line\n", "\nnext"], "line", True),
])
def test_stop_text_cuts_at_the_first_stop_string(stops, pieces, want, hit):
    assert _feed(stops, pieces) == (want, hit)


def test_stop_text_never_shows_a_stop_string_early():
    cut = StopText(["abc"])
    assert cut.feed("xxab") == "xx" and cut.held == "ab"
    assert cut.feed("d") == "abd" and not cut.hit


def test_prompt_ids_follow_the_chat_template(tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    rendered = "system: be brief\nuser: hi\nassistant: hello\nuser: more\nassistant: "   # the tiny template
    want = tok(rendered, add_special_tokens=False)["input_ids"]
    req = proto.PromptRequest(request_id=1, messages=turns, max_new_tokens=4)
    assert prompt_ids(tok, req) == chat_ids(tok, turns) == want
    one = proto.PromptRequest(request_id=1, text="hi", max_new_tokens=4)
    assert prompt_ids(tok, one) == tok("user: hi\nassistant: ", add_special_tokens=False)["input_ids"]
    raw = proto.PromptRequest(request_id=1, text="hi", max_new_tokens=4, raw=True)
    assert prompt_ids(tok, raw) == tok("hi")["input_ids"]
    tok.chat_template = None
    with pytest.raises(PromptError, match="no chat template"):
        chat_ids(tok, turns)


def test_api_keys_and_exposure(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# ops\n{'f' * 20}\n\n")
    keys = load_api_keys((KEY,), str(f), env={"FLOWEDGE_API_KEYS": f"{'e' * 16}, {KEY}"})
    assert keys == (KEY, "e" * 16, "f" * 20)
    with pytest.raises(ConfigError, match="at least 16"):
        load_api_keys(("short",), env={})
    check_exposure("127.0.0.1", ())
    check_exposure("::1", ())
    check_exposure("0.0.0.0", keys)
    for host in ("0.0.0.0", "192.168.1.5", "::", "gateway.local"):
        with pytest.raises(ConfigError, match="without an API key"):
            check_exposure(host, ())


@pytest.fixture(scope="module")
def api():
    """The app in front of a head that is not there: everything up to the head is checked."""
    settings = ApiSettings(head="127.0.0.1:9", api_keys=(KEY,), status_timeout_s=0.3, request_timeout_s=0.5,
                           insecure=True)   # no head, so no cluster keys needed
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {KEY}"
        yield client


def test_bad_bodies_are_400_with_openai_errors(api):
    cases = [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[]"),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}'),
        ("/v1/completions", b'{"prompt": ["a", "b"]}'),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}'),
    ]
    for path, body in cases:
        r = api.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], body


@pytest.mark.parametrize("path,body,says", [
    ("/v1/completions", {"prompt": [True, False]}, "prompt: "),          # booleans are not token ids
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream: "),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream: "),
    ("/v1/completions", {"prompt": "x", "echo": "no"}, "echo: "),
    ("/v1/completions", {"prompt": "x", "n": True}, "n: "),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens: "),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, "seed: "),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt: "),
    ("/v1/completions", {"prompt": "x" * 1_000_000}, "too long"),        # under the body cap, over the prompt's
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1_000_000}]}, "too long"),
])
def test_client_mistakes_are_400_with_a_message_about_the_request(api, path, body, says):
    """Before any head is asked (there is none here: a request that got that far would be 503)."""
    r = api.post(path, json=body)
    assert r.status_code == 400, (body, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and says in err["message"], err


def test_an_unreachable_head_is_503_and_health_says_so(api):
    r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and "cannot reach" in r.json()["error"]["message"]
    assert r.headers.get("x-should-retry") == "false"   # the openai client's 2 retries took 7.4 s in all
    assert api.get("/health").status_code == 503
    assert api.get("/v1/models").status_code == 503


def test_requests_without_the_key_are_401(api):
    for key in (None, "Bearer wrong-key-wrong-key", f"Basic {KEY}"):
        headers = {"Authorization": key} if key else {}
        r = api.get("/v1/models", headers=headers) if key else TestClient(api.app).get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", key
    assert TestClient(api.app).get("/health").status_code == 503   # open, and honest: no head


def test_content_length_over_the_limit_is_413(api):
    r = api.post("/v1/completions", content=b"x" * ((1 << 20) + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_status_view_renders_rates_from_two_replies():
    from flowedge.launch.status_view import render

    def reply(tokens: int) -> list[dict]:
        return [{"node_id": "head", "role": "head", "queue": 2, "ready": True, "load": 0.9,
                 "served": {"requests": 3, "tokens": tokens, "failed": 0, "cancelled": 1},
                 "last_request": {"tokens_per_s": 4.5, "mean_accept_len": 2.25, "strategy": "flowspec"}},
                {"node_id": "s1", "role": "stage", "stage": 1, "layers": [0, 14], "load": 0.4,
                 "step_ms_median": 12.5, "ready": True}]

    text = render(reply(300), reply(100), 4.0)
    assert "tokens/s 50.00" in text and "queue 2" in text and "accepted length 2.25" in text
    assert "cancelled 1" in text and "12.5" in text and "[0, 14)" in text and "running now" not in text
    streaming = reply(300)
    streaming[0]["requests"] = {"active": [{"mean_accept_len": 1.5}, {"mean_accept_len": 2.5}]}
    assert "running now: accepted length 2.00" in render(streaming, reply(100), 4.0)


def test_status_metrics_and_the_dashboard_show_the_same_figures():
    """One head status, three readers: `flowedge status`, /metrics and the dashboard's stream. Before:
    status counted the running request as queued and had no tokens/s of its own; a client's context
    overflow was one more "failed"."""
    import asyncio
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from flowedge.api.dashboard import status_events
    from flowedge.api.metrics import ApiMetrics
    from flowedge.launch.status_view import render

    nodes = [{"node_id": "head", "role": "head", "queue": 3, "ready": True, "load": 0.75,
              "served": {"requests": 4, "tokens": 120, "rejected": 2, "failed": 1, "cancelled": 1},
              "requests": {"queued": 2, "running": 1, "paused": 0, "tokens_per_s": 12.5, "active": []}}]
    text = render(nodes)
    assert "queued 2   running 1   tokens/s 12.50" in text and "(rejected 2, failed 1, cancelled 1)" in text
    assert " 0.75 " in text.splitlines()[1]   # the head's load
    metrics = ApiMetrics()
    metrics.cluster(nodes)
    samples = {(s.name, s.labels.get("outcome")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("flowedge_requests_queued", None)] == 2 and samples[("flowedge_requests_running", None)] == 1
    assert samples[("flowedge_head_tokens_per_second", None)] == 12.5 and samples[("flowedge_head_load", None)] == 0.75
    assert samples[("flowedge_head_requests", "rejected")] == 2 and samples[("flowedge_head_requests", "failed")] == 1

    async def first_event() -> dict:
        async def fetch():
            return nodes
        events = status_events(fetch, interval_s=0)
        line = await anext(events)
        await events.aclose()
        return json.loads(line.removeprefix(b"data: "))

    head = asyncio.run(first_event())["nodes"][0]   # what the page reads: the same figures, as the head gave them
    assert head["requests"]["queued"] == 2 and head["requests"]["running"] == 1
    assert head["served"]["failed"] == 1 and head["served"]["rejected"] == 2


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_http_unit_passes_systemd_analyze_verify(tmp_path):
    unit = "flowedge-http.service"
    text = (Path(__file__).parent.parent / "systemd" / unit).read_text()
    assert "FLOWEDGE_API_KEYS" in text and "EnvironmentFile=" in text
    # verify checks that ExecStart's program exists: point it at one that does on this machine.
    (tmp_path / unit).write_text(text.replace("/opt/flowedge/.venv/bin/flowedge", shutil.which("true") or "/bin/true"))
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and unit not in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.fixture(scope="module")
def live_api():
    """The app under uvicorn on a real port (header deadline 1 s), in front of a head that is not there."""
    import socket
    import threading
    import time

    from flowedge.api.server import build_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ApiSettings(head="127.0.0.1:9", header_timeout_s=1.0, read_timeout_s=3.0, status_timeout_s=0.3,
                           request_timeout_s=0.5, insecure=True)
    server = build_server(settings, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(timeout=5)


def test_a_client_trickling_its_headers_is_cut_off_and_others_are_served(live_api):
    import socket
    import time

    import httpx

    t0 = time.monotonic()
    slow, silent = socket.create_connection(("127.0.0.1", live_api)), socket.create_connection(("127.0.0.1", live_api))
    with slow, silent:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert httpx.get(f"http://127.0.0.1:{live_api}/health").status_code == 503   # served meanwhile
        assert 0.9 < closed_after_s(slow, b"X-Slow: 1\r\n", t0) < 2.5
        assert closed_after_s(silent, b"", t0) < 2.5   # one that sends nothing at all
    # the deadline covers the head only: a body slower than it (within the body timeout) is still read
    with socket.create_connection(("127.0.0.1", live_api)) as body:
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 15\r\n\r\n")
        time.sleep(1.5)
        body.sendall(b'{"prompt": "a"}')
        body.settimeout(5)
        assert body.recv(4096).startswith(b"HTTP/1.1 503")   # answered (the head is not there)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_admission_closes_only_connections_that_waited_past_the_grace_oldest_first():
    from flowedge.api.admission import Admission

    clock = Clock()
    a = Admission(per_address=2, total=3, grace_s=0.5, clock=clock)
    assert a.waits("x1", "10.0.0.1").close == [] and a.waits("x2", "10.0.0.1").close == []
    clock.t = 1.0
    assert a.waits("x3", "10.0.0.1").close == ["x1"]     # a third from one address: its oldest trickler goes
    assert a.waits("y1", "10.0.0.2").close == []
    clock.t = 2.0
    assert a.waits("y2", "10.0.0.2").close == ["x2"]     # a fourth in all: the oldest of all goes
    a.done("x3")                                          # its head arrived: it no longer counts
    assert a.count() == 2 and a.count("10.0.0.2") == 2
    assert a.waits("y1", "10.0.0.2").close == []         # a keep-alive connection waiting again is the newest
    assert list(a.waiting) == ["y2", "y1"] and a.evicted == 2


def test_a_burst_is_queued_not_cut_and_let_in_as_heads_arrive():
    from flowedge.api.admission import Admission

    clock = Clock()
    a = Admission(per_address=2, total=4, grace_s=0.5, queue_limit=3, clock=clock)
    verdicts = [a.waits(f"b{i}", "10.0.0.1") for i in range(5)]          # five at once from one address
    assert [v.close for v in verdicts] == [[]] * 5
    assert [v.queued for v in verdicts] == [False, False, True, True, True]
    assert a.waits("b5", "10.0.0.1").close == ["b5"] and a.refused == 1   # past the queue: the newest goes
    assert a.waits("c0", "10.0.0.2").queued is False                     # another address has its own room
    assert a.done("b0") == ["b2"] and a.done("b1") == ["b3"]             # heads arrive: the queue moves on
    assert a.done("b2") == ["b4"] and a.done("b4") == [] and a.evicted == 0
    assert not a.waits("b7", "10.0.0.1").queued                          # with b3, its address is full again
    assert a.waits("b6", "10.0.0.1").queued
    assert a.retry("b6").queued and a.retry("b6").close == []            # nobody stale yet: it waits
    clock.t = 1.0
    verdict = a.retry("b6")                                              # past the grace: b3 makes room
    assert verdict.close == ["b3"] and not verdict.queued and a.evicted == 1


def _rest_of_answer(sock, start: bytes) -> bytes:
    """`start` and whatever else the server sends until it closes (the answers here close)."""
    sock.settimeout(5)
    data = start
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def _connect_from(port: int, source: str):
    import socket

    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _server_closed(sock) -> bool:
    sock.settimeout(0.5)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def crowded_api():
    """A server with room for 8 connections, 3 per address without a complete head, head deadline 8 s."""

    from flowedge.api.server import build_server

    settings = ApiSettings(head="127.0.0.1:9", header_timeout_s=8.0, status_timeout_s=0.3, request_timeout_s=0.5,
                           insecure=True, max_connections=8, max_connections_per_address=3)
    server = build_server(settings, "127.0.0.1", 0, log_level="warning")
    with serving(server) as port:
        yield port


def _health_from(port: int, source: str):
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=5) as c:
        return c.get(f"http://127.0.0.1:{port}/health")


def test_one_address_trickling_headers_cannot_lock_others_out(crowded_api):
    """Once ~130 header-trickling connections from one address left /health 2 answers out of 44.
    12 here against a cap of 8 (3 waiting per address): another address is served at once, and the same
    address within about the grace, its oldest trickler closed to make room."""
    import time

    slow = []
    try:
        for _ in range(12):
            slow.append(_connect_from(crowded_api, "127.0.0.1"))
            slow[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        r = _health_from(crowded_api, "127.0.0.2")
        assert r.status_code == 503 and r.json() == {"status": "head unreachable"}, r.text   # the app answered
        t0 = time.monotonic()
        r = _health_from(crowded_api, "127.0.0.1")     # the same address still gets in (its stale waits go)
        assert r.json() == {"status": "head unreachable"}, r.text
        assert time.monotonic() - t0 < 4.0
        assert _server_closed(slow[0])
    finally:
        for s in slow:
            s.close()


def test_many_addresses_trickling_headers_cannot_fill_the_server(crowded_api):
    """3 waiting connections from each of 5 addresses (15) against a cap of 8: past three quarters of the
    cap the rest are queued, unread and uncounted, the oldest closed once past the grace, and a complete
    request from another address still gets in."""
    slow = []
    try:
        for k in range(3, 8):
            for _ in range(3):
                slow.append(_connect_from(crowded_api, f"127.0.0.{k}"))
                slow[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        r = _health_from(crowded_api, "127.0.0.2")
        assert r.status_code == 503 and r.json() == {"status": "head unreachable"}, r.text
        assert _server_closed(slow[0])
    finally:
        for s in slow:
            s.close()


def test_a_body_trickled_a_byte_at_a_time_meets_one_deadline_for_the_whole_body(live_api):
    """The read timeout was once per piece, so a byte every 0.5 s (read timeout 3 s) held the
    connection for ever. Now the whole body has 3 s: answered 400, not before and not much after."""
    import socket
    import time

    with socket.create_connection(("127.0.0.1", live_api)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")
        t0 = time.monotonic()
        s.settimeout(0.5)
        answer = b""
        while not answer and time.monotonic() - t0 < 8:
            try:
                s.sendall(b" ")
                answer = s.recv(4096)
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                break
        took = time.monotonic() - t0
        answer = _rest_of_answer(s, answer)
    assert answer.startswith(b"HTTP/1.1 400") and b"incomplete after 3 s" in answer, (answer[:300], took)
    assert 2.5 < took < 5.0, took


def test_a_head_over_16_kib_is_refused_however_it_arrives(live_api):
    """A 60 KiB head once sent at once passed h11, whose cap only bounds an incomplete head."""
    import socket

    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-Filler-%d: %s\r\n" % (i, b"y" * 1000) for i in range(60)) + b"\r\n"
    with socket.create_connection(("127.0.0.1", live_api)) as s:
        s.sendall(head)
        answer = _rest_of_answer(s, b"")
    assert answer.startswith(b"HTTP/1.1 431") and b"request head over 16384 bytes" in answer, answer[:300]


UNSUPPORTED_BODIES = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("response_format", {"type": "json_object"}),
    ("logprobs", True),
    ("top_logprobs", 3),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1.0),
    ("logit_bias", {"42": 10}),
    ("n", 2),
    ("min_p", 0.1),
    ("repetition_penalty", 1.2),
]


@pytest.mark.parametrize("field,value", UNSUPPORTED_BODIES)
def test_unsupported_fields_are_400_naming_the_field(api, field, value):
    """Before: answered 200 as if the field were not there."""
    r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field and f"`{field}`" in err["message"]


@pytest.mark.parametrize("field,value", [("presence_penalty", 0), ("frequency_penalty", 0.0), ("logprobs", False),
                                         ("tools", []), ("logit_bias", {}), ("n", 1), ("min_p", 0),
                                         ("repetition_penalty", 1.0)])
def test_unsupported_fields_at_their_off_value_pass_validation(api, field, value):
    r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 503, r.text   # validated, then the missing head


def test_every_error_path_has_the_openai_shape(api):
    """Before: FastAPI's {"detail": ...} for 404 and 405, and `"param": "14"` (a byte offset) for bad JSON."""
    for r, status in ((api.get("/v2/nothing"), 404), (api.get("/v1/chat/completions"), 405),
                      (api.delete("/v1/models"), 405)):
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
        assert r.json()["error"]["message"] and "type" in r.json()["error"]
    r = api.post("/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None and "not valid JSON" in err["message"], err


def test_an_unknown_model_is_404_listing_the_served_ones(api):
    api.app.state.routes._model = "/models/tiny-base"   # as if the head had said so
    r = api.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", err
    assert "gpt-4o" in err["message"] and "tiny-base" in err["message"]
    for name in ("tiny-base", "/models/tiny-base", ""):
        r = api.post("/v1/completions", json={"model": name, "prompt": "x"})
        assert r.status_code == 503, (name, r.text)   # accepted, then the missing head


def test_client_errors_are_exported_and_typed():
    import flowedge
    from flowedge.client.client_core import ClientCore
    from flowedge.transport import protocol as proto

    assert issubclass(flowedge.ContextOverflow, flowedge.RequestFailed)
    assert issubclass(flowedge.RequestFailed, flowedge.FlowedgeError)
    with pytest.raises(flowedge.ContextOverflow, match="maximum context length is 64 tokens"):
        from flowedge.text.prompts import check_context
        check_context(60, 10, 64)
    try:
        check_context(60, 10, 64)
    except flowedge.ContextOverflow as err:
        wire = str(err)
    assert "--max-new-tokens" not in wire
    core = ClientCore("127.0.0.1:1")

    def refused(message: str) -> Exception:
        rid = core.start(core.request("x"), 0.0).request_id
        [failed] = core.receive(proto.ErrorReply(request_id=rid, message=message), 0.1)
        return failed.error

    assert isinstance(refused(wire), flowedge.ContextOverflow)
    other = refused("internal error: boom")
    assert isinstance(other, flowedge.RequestFailed) and not isinstance(other, flowedge.ContextOverflow)
    assert isinstance(refused("cluster not ready: waiting for stage 2"), flowedge.ClusterNotReady)


def test_context_overflow_is_worded_and_coded_as_openai_does():
    """Client libraries (litellm, LangChain) spot a context overflow by OpenAI's own words and code."""
    from flowedge.api.app import classify
    from flowedge.text.prompts import check_context
    from flowedge.errors import ContextOverflow

    with pytest.raises(ContextOverflow) as info:
        check_context(60, 10, 64)
    api = classify(info.value)
    assert (api.status, api.code, api.kind, api.param) == (400, "context_length_exceeded", "invalid_request_error",
                                                          "messages")
    assert str(api).startswith("This model's maximum context length is 64 tokens. However, you requested 70 "
                               "tokens (60 in the messages, 10 in the completion).")
    empty = classify(ContextOverflow("the prompt is empty after tokenization"))
    assert empty.status == 400 and empty.code is None


def test_a_missing_stage_is_503_with_retry_after_naming_the_stage():
    from flowedge.api.app import classify
    from flowedge.errors import ClusterNotReady, refusal

    api = classify(refusal("cluster not ready: waiting for stage 2 (stage 2 (stage-2) disconnected), and no "
                           "node took its place within 3 s"))
    assert isinstance(refusal("cluster not ready: x"), ClusterNotReady)
    assert api.status == 503 and api.code == "cluster_not_ready" and "stage 2" in str(api)
    assert int(api.headers["retry-after"]) > 0


@pytest.mark.parametrize("content,says", [
    ([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
     "image content parts are not supported; send text"),
    ([{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}],
     "input_audio content parts are not supported; send text"),
    (5, "must be a string or a list of text parts"),
])
def test_content_flowedge_cannot_read_is_one_readable_400(api, content, says):
    """Before: `messages.0.content.str: Input should be a valid string` (pydantic's path into a union)."""
    r = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"] == f"messages[0].content: {says}", err
    assert err["param"] == "messages[0].content" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,says", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role: Input should be 'system', 'developer', "
                                                         "'user' or 'assistant' (got 'wizard')"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 7}, "temperature: Input should be less than or "
                                                                         "equal to 2 (got 7)"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop: at most 16 non-empty stop strings"),
])
def test_400_texts_say_where_and_what_in_words(api, body, says):
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(says), r.text


def test_models_lists_the_model_s_name_and_when_it_was_made(api, monkeypatch):
    """Before: the head's filesystem path as the id, and `created: 0`."""
    routes = api.app.state.routes

    async def head_status():
        return [{"role": "head", "model": "/srv/models/tiny-base", "model_created": 1_700_000_000,
                 "started_unix": 1_800_000_000.5}]

    monkeypatch.setattr(routes, "head_status", head_status)
    (model,) = api.get("/v1/models").json()["data"]
    assert model == {"id": "tiny-base", "object": "model", "created": 1_700_000_000, "owned_by": "flowedge"}


def test_a_body_sent_without_its_json_content_type_is_told_so(api):
    r = api.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}]}',
                 headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["message"] == ("the body must be a JSON object, sent with "
                                                                     "Content-Type: application/json"), r.text
    r = api.post("/v1/chat/completions", json=["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body must be a JSON object", r.text


def test_top_k_reaches_the_head_as_the_python_client_sends_it():
    """top_k (an extension, as vLLM and llama.cpp take it) was once dropped by the HTTP front without a
    word: a sampled answer with top_k 1 was not the greedy one."""
    from flowedge.api.schema import ChatRequest

    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 1.0, "seed": 5}
    assert ChatRequest.model_validate({**body, "top_k": 1}).client_kwargs(16)["top_k"] == 1
    assert ChatRequest.model_validate(body).client_kwargs(16)["top_k"] is None


def test_a_completion_s_max_tokens_null_is_openai_s_default():
    from flowedge.api.schema import CompletionRequest

    for body in ({"prompt": "x"}, {"prompt": "x", "max_tokens": None}):
        assert CompletionRequest.model_validate(body).client_kwargs(256)["max_new_tokens"] == 16
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": 3}).client_kwargs(256)["max_new_tokens"] == 3
