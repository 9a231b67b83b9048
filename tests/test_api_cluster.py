"""The OpenAI-compatible HTTP API against a real tiny-model cluster (3 processes, loopback), driven by
the official `openai` client, httpx and raw sockets. Temperature 0 and float32 on the wire, so every
answer must equal plain greedy decoding of the same prompt ids."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster_helpers import READY_TIMEOUT_S, flowedge_cli, flowedge_home, free_port_pair, logs, wait_for_text
from flowedge import AsyncClient
from flowedge.api.server import build_server
from flowedge.api.settings import ApiSettings
from flowedge.client.sync_client import Client, RequestFailed, wait_ready
from flowedge.errors import FlowedgeError
from flowedge.launch import local_cluster
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.text.prompts import chat_ids
from flowedge.generate import GenerateRequest, run_generate

KEY = "test-key-0123456789abcdef"
NAME = "base"   # the served model's name: the last part of the tiny base model's path (it answers to both)
PROMPT = "zzzz"
MAX_NEW = 30
LONG_PROMPT = "1 2 3 4"   # the tiny model does not stop by itself on this one


@pytest.fixture(scope="module")
def reference(tiny_pair):
    base, draft = tiny_pair
    chat = run_generate(GenerateRequest(PROMPT, str(base), str(draft), "ar", MAX_NEW))
    raw = run_generate(GenerateRequest(PROMPT, str(base), str(draft), "ar", MAX_NEW, chat=False))
    assert chat["new_tokens"] >= 20 and raw["new_tokens"] >= 20   # the comparisons cover real decoding
    return {"chat": chat, "raw": raw}


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    """A cluster and the HTTP API in front of it; /health is asked before the cluster is ready."""
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                wire_dtype="float32", device="orin-nano-8gb")
        cluster = local_cluster.start(spec)
        settings = ApiSettings(head=spec.addr, api_keys=(KEY,), read_timeout_s=1.0, request_timeout_s=60)
        server = build_server(settings, "127.0.0.1", 0, log_level="warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                time.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            base_url = f"http://127.0.0.1:{port}"
            health_before = httpx.get(base_url + "/health", timeout=10)
            try:
                wait_ready(spec.addr, READY_TIMEOUT_S, alive=cluster.alive)
            except FlowedgeError as err:
                raise AssertionError(f"cluster did not start: {err}\n{logs(cluster.run_dir)}") from None
            yield {"cluster": cluster, "url": base_url, "port": port, "health_before": health_before,
                   "model": str(base)}
        finally:
            server.should_exit = True
            thread.join(10)
            cluster.stop()


@pytest.fixture()
def oai(stack):
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def test_health_is_503_until_the_cluster_is_ready(stack):
    assert stack["health_before"].status_code == 503
    r = httpx.get(stack["url"] + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_openai_client_models_and_chat(stack, oai, reference):
    (model,) = oai.models.list().data
    assert model.id == NAME and model.created > 0   # the model's name, not a path on the head's disk
    msgs = [{"role": "user", "content": PROMPT}]
    whole = oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX_NEW, temperature=0)
    want = reference["chat"]
    assert whole.choices[0].message.content == want["text"]
    assert whole.choices[0].finish_reason == ("length" if want["new_tokens"] == MAX_NEW else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want["prompt_tokens"], want["new_tokens"])
    chunks = list(oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX_NEW, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want["new_tokens"]
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_client_completions_are_raw(oai, reference):
    want = reference["raw"]
    whole = oai.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    assert whole.choices[0].text == want["text"] and whole.usage.prompt_tokens == want["prompt_tokens"]
    pieces = [c.choices[0].text for c in oai.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_NEW,
                                                                 temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == want["text"]


def test_system_prompt_and_turns_go_through_the_chat_template(oai, tiny_pair):
    from transformers import AutoTokenizer

    turns = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "abc"},
             {"role": "assistant", "content": "def"}, {"role": "user", "content": PROMPT}]
    ids = chat_ids(AutoTokenizer.from_pretrained(tiny_pair[0]), turns)
    chat = oai.chat.completions.create(model=NAME, messages=turns, max_tokens=MAX_NEW, temperature=0)
    assert chat.usage.prompt_tokens == len(ids)
    # the same ids sent as a token prompt give the same answer: the head built exactly these ids
    same = oai.completions.create(model=NAME, prompt=ids, max_tokens=MAX_NEW, temperature=0)
    assert same.choices[0].text == chat.choices[0].message.content
    one = oai.chat.completions.create(model=NAME, messages=turns[-1:], max_tokens=MAX_NEW, temperature=0)
    assert one.usage.prompt_tokens < len(ids)


def test_stop_sequences_cut_the_answer(stack, oai, reference):
    text = reference["chat"]["text"]
    stop = text[8:11]
    cut = text[:text.find(stop)]
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_NEW,
                                    temperature=0, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < reference["chat"]["new_tokens"]
    streamed = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=MAX_NEW, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut
    assert _stages_hold_nothing(stack)   # the stopped request's KV is gone from every stage


def test_client_mistakes_are_400_and_keys_are_required(stack, oai):
    before = _served(stack)
    with pytest.raises(openai.BadRequestError, match="context") as info:
        oai.completions.create(model=NAME, prompt="x", max_tokens=5000, temperature=0)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    said = info.value.body["message"]
    assert said.startswith("This model's maximum context length is ") and "5000 in the completion" in said
    assert "--max-new-tokens" not in said
    after = _served(stack)   # the client's mistake: rejected, not a failure of the cluster
    assert (after["rejected"] - before["rejected"], after["failed"] - before["failed"]) == (1, 0)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=7)
    r = httpx.post(stack["url"] + "/v1/chat/completions", content=b'{"messages": [', headers=_auth())
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    bad = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="not-the-key-not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for path in ("/v1/models", "/metrics", "/v1/status"):
        assert httpx.get(stack["url"] + path).status_code == 401
    r = httpx.post(stack["url"] + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401


def test_out_of_vocabulary_ids_are_400_and_the_empty_prompt_is_refused_everywhere(stack, oai):
    """Codes that were once wrong: an id past the embedding was a 500 IndexError; the empty prompt, refused
    over HTTP, was answered through the Client and the CLI."""
    with pytest.raises(openai.BadRequestError, match="not in the model's vocabulary"):
        oai.completions.create(model=NAME, prompt=[1_000_000], max_tokens=4, temperature=0)
    addr = stack["cluster"].spec.addr
    with Client(addr, timeout_s=30) as c:
        with pytest.raises(RequestFailed, match="not in the model's vocabulary"):
            c.generate([3, 1_000_000], max_new_tokens=4)
        with pytest.raises(FlowedgeError, match="the prompt is empty"):
            c.generate("", max_new_tokens=4)
        assert c.generate(PROMPT, max_new_tokens=2)["new_tokens"] == 2   # the connection serves on

    async def empty_async() -> None:
        async with AsyncClient(addr, timeout_s=30) as c:
            await c.generate("", max_new_tokens=4)

    with pytest.raises(FlowedgeError, match="the prompt is empty"):
        asyncio.run(empty_async())
    out = flowedge_cli("prompt", "", "--head", addr, "--max-new-tokens", "4")
    assert out.returncode == 1 and "error: the prompt is empty" in out.stderr, (out.returncode, out.stderr[-500:])
    with pytest.raises(openai.BadRequestError, match="the prompt is empty"):
        oai.completions.create(model=NAME, prompt="", max_tokens=4)


def _raw_request(port: int, head: bytes, body: bytes) -> tuple[bytes, float]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return data, time.monotonic() - t0


def test_a_bad_content_length_is_answered_not_hung(stack):
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
    short, took = _raw_request(stack["port"], start + b"Content-Length: 100\r\n\r\n", b'{"prompt": "x"}')
    assert short.startswith(b"HTTP/1.1 400") and took < 5, (short, took)   # read timeout 1 s
    junk, took = _raw_request(stack["port"], start + b"Content-Length: lots\r\n\r\n", b'{"prompt": "x"}')
    assert junk.startswith(b"HTTP/1.1 400") and took < 2, (junk, took)


def _metric_families(stack) -> dict:
    text = httpx.get(stack["url"] + "/metrics", headers=_auth()).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_parse_and_count(stack, oai):
    requests_before = _metric_families(stack)["flowedge_http_requests"]
    httpx.post(stack["url"] + "/v1/completions", json={"model": NAME, "prompt": PROMPT})   # no key: 401
    oai.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    families = _metric_families(stack)

    def value(name: str, family=None, **labels) -> float:   # a counter's family drops the sample's _total
        family = family or families[name.removesuffix("_total")]
        return sum(s.value for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("flowedge_http_requests_total", endpoint="/v1/completions", outcome="ok") >= 1
    unauthorized = value("flowedge_http_requests_total", outcome="unauthorized")
    assert unauthorized == value("flowedge_http_requests_total", requests_before, outcome="unauthorized") + 1
    assert value("flowedge_tokens_generated_total") >= 5
    assert value("flowedge_cluster_ready") == 1 and value("flowedge_head_up") == 1
    assert value("flowedge_requests_in_flight") == 0 and value("flowedge_queue_depth") == 0
    assert value("flowedge_mean_accepted_length") > 0 and value("flowedge_tokens_per_second") > 0
    stages = {s.labels["stage"] for s in families["flowedge_stage_busy_fraction"].samples}
    assert stages == {"1", "2"}
    assert {s.labels["stage"] for s in families["flowedge_stage_kv_tokens"].samples} == {"1", "2"}
    assert "flowedge_stage_step_ms" in families and "flowedge_failures" in families


def _served(stack) -> dict:
    with Client(stack["cluster"].spec.addr, timeout_s=10) as c:
        return c.status()[0]["served"]


def _stages_hold_nothing(stack, timeout_s: float = 5.0) -> bool:
    """Every stage's heartbeat reports no KV entries and no requests (within a few heartbeats)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with Client(stack["cluster"].spec.addr, timeout_s=10) as c:
            stages = c.status()[1:]
        if all(n.get("kv_tokens") == 0 and n.get("requests") == 0 for n in stages):
            return True
        time.sleep(0.2)
    return False


def test_a_client_that_disconnects_mid_stream_is_cancelled_at_the_head(stack, oai, reference):
    before = _served(stack)["cancelled"]
    body = {"model": NAME, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1500,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", stack["url"] + "/v1/chat/completions", json=body, headers=_auth(),
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while _served(stack)["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _served(stack)["cancelled"] == before + 1, logs(stack["cluster"].run_dir)
    assert _stages_hold_nothing(stack), logs(stack["cluster"].run_dir)   # KV freed on every stage
    assert wait_for_text(stack["cluster"].run_dir / "head.log", "cancelled", 5)   # the head logs the cancel
    # the head serves the next request at once, and correctly
    r = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_NEW,
                                    temperature=0)
    assert r.choices[0].message.content == reference["chat"]["text"]


def test_async_client_streams_and_cancels(stack, reference):
    addr = stack["cluster"].spec.addr

    async def run() -> tuple[str, dict]:
        async with AsyncClient(addr, timeout_s=30) as c:
            text = "".join([p async for p in c.stream(PROMPT, max_new_tokens=MAX_NEW)])
            result = c.last_result
            async for _ in c.stream(LONG_PROMPT, max_new_tokens=1500):
                break   # leaving the loop cancels the request
            return text, result

    before = _served(stack)["cancelled"]
    text, result = asyncio.run(run())
    assert text == reference["chat"]["text"] and result["token_ids"] == reference["chat"]["token_ids"]
    deadline = time.monotonic() + 10
    while _served(stack)["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _served(stack)["cancelled"] == before + 1
    assert _stages_hold_nothing(stack)


def test_prompt_cli_system_stop_conversation(stack, reference, tmp_path):
    addr = stack["cluster"].spec.addr
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps([{"role": "user", "content": PROMPT}]))
    out = flowedge_cli("prompt", "--conversation", str(conv), "--head", addr, "--max-new-tokens", str(MAX_NEW),
                       "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["token_ids"] == reference["chat"]["token_ids"]
    stop = reference["chat"]["text"][8:11]
    out = flowedge_cli("prompt", PROMPT, "--stop", stop, "--head", addr, "--max-new-tokens", str(MAX_NEW), "--json")
    res = json.loads(out.stdout)
    assert res["finish_reason"] == "stop" and res["text"] == reference["chat"]["text"].split(stop)[0]
    out = flowedge_cli("prompt", PROMPT, "--system", "be terse", "--head", addr, "--max-new-tokens", "2", "--json")
    assert json.loads(out.stdout)["prompt_tokens"] == reference["chat"]["prompt_tokens"] + len("system: be terse\n")


def test_http_refuses_to_listen_beyond_loopback_without_a_key():
    out = flowedge_cli("http", "--listen", "0.0.0.0:0", env={"FLOWEDGE_API_KEYS": ""}, timeout=60)
    assert out.returncode == 78 and "refusing to listen on 0.0.0.0 without an API key" in out.stderr   # EX_CONFIG


def test_status_watch_redraws_in_place(stack):
    out = flowedge_cli("status", "--watch", "--interval", "0.2", "--iterations", "2", "--head",
                       stack["cluster"].spec.addr)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\x1b[H\x1b[J") == 2 and "tokens/s" in out.stdout and "stage-2" in out.stdout


def test_a_client_that_leaves_a_whole_answer_is_cancelled_too(stack):
    """A client of a whole (non-streamed) answer leaves once the head runs its request: the request is
    cancelled at the head. (It leaves on that sign, not on a timer: the tiny model writes 1500 tokens in
    about 2 s, so a timer raced the answer's end on a loaded box or left before the head had it.)"""
    before = _served(stack)["cancelled"]
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1500,
                       "temperature": 0}).encode()
    url = httpx.URL(stack["url"])
    head = "".join(f"{k}: {v}\r\n" for k, v in {**_auth(), "Content-Type": "application/json",
                                                  "Content-Length": str(len(body))}.items())
    with Client(stack["cluster"].spec.addr, timeout_s=10) as c:
        def active() -> set[int]:
            return {r["id"] for r in c.status()[0]["requests"]["active"]}

        earlier = active()   # requests of earlier tests may still be winding down: ours is a new id
        sock = socket.create_connection((url.host, url.port), timeout=10)
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}\r\n{head}\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while not (active() - earlier) and time.monotonic() < deadline:
            time.sleep(0.02)
    sock.close()   # gone while the head is still answering
    deadline = time.monotonic() + 30   # the cancel is what counts, not its speed on a loaded box
    while _served(stack)["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _served(stack)["cancelled"] == before + 1
    assert _stages_hold_nothing(stack)


def test_concurrent_http_requests_are_served_side_by_side(stack, reference):
    """The API never blocks its event loop: several answers in flight at once, each still exact."""
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": PROMPT}]
        replies = await asyncio.gather(*[client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=MAX_NEW, temperature=0) for _ in range(3)])
        await client.close()
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(run()) == [reference["chat"]["text"]] * 3


UNSUPPORTED = [dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
               dict(tool_choice="none"), dict(response_format={"type": "json_object"}), dict(logprobs=True),
               dict(logprobs=True, top_logprobs=2), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
               dict(n=2), dict(logit_bias={"3": 5})]


@pytest.mark.parametrize("extra", UNSUPPORTED, ids=lambda e: "-".join(e))
def test_the_openai_client_gets_400_naming_each_unsupported_field(oai, extra):
    """Before: 200, the field silently ignored."""
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2, **extra)
    assert info.value.param in extra and f"`{info.value.param}`" in info.value.message, info.value.body


def test_an_unknown_model_is_404_and_the_served_names_work(stack, oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert info.value.code == "model_not_found" and NAME in info.value.message
    served = oai.models.list().data[0].id
    assert served == NAME
    for name in (NAME, stack["model"]):
        r = oai.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.model == served and r.usage.completion_tokens == 2


def test_context_overflow_reaches_both_clients_typed(stack):
    from flowedge import ContextOverflow, RequestFailed as Exported

    addr = stack["cluster"].spec.addr
    with Client(addr, timeout_s=30) as c, pytest.raises(ContextOverflow, match="maximum context length is"):
        c.generate(PROMPT, max_new_tokens=100_000)

    async def run() -> None:
        async with AsyncClient(addr, timeout_s=30) as c:
            await c.generate(PROMPT, max_new_tokens=100_000)

    with pytest.raises(Exported):
        asyncio.run(run())


def test_one_async_client_carries_concurrent_requests(stack, reference):
    """Before: one request at a time per AsyncClient (a second `await` read the first one's replies)."""
    async def run() -> tuple[list[dict], list[dict]]:
        async with AsyncClient(stack["cluster"].spec.addr, timeout_s=60) as c:
            answers = await asyncio.gather(*[c.generate(PROMPT, max_new_tokens=MAX_NEW) for _ in range(3)],
                                           c.status())
            streamed = [p async for p in c.stream(PROMPT, max_new_tokens=MAX_NEW)]
            return answers, streamed

    answers, streamed = asyncio.run(run())
    texts = [a["text"] for a in answers[:3]]
    assert texts == [reference["chat"]["text"]] * 3 and "".join(streamed) == reference["chat"]["text"]
    assert isinstance(answers[3], list) and answers[3][0].get("ready")
    assert _stages_hold_nothing(stack)


def test_status_and_metrics_show_live_tokens_per_s_and_the_head_s_load_during_an_answer(stack):
    """Before: `flowedge status` said `tokens/s -` during an answer (one reply has no rate of its own), and
    the head's load was always 0.00 (a new psutil.Process each call, whose first cpu_percent is 0)."""
    import re

    from flowedge.launch.status_view import render

    addr = stack["cluster"].spec.addr
    with Client(addr, timeout_s=60) as asker, Client(addr, timeout_s=10) as probe:
        for k, _ in enumerate(asker.stream(LONG_PROMPT, max_new_tokens=1500)):
            if k == 20:
                nodes = probe.status()
                metrics = httpx.get(stack["url"] + "/metrics", headers=_auth()).text
                break
    head = nodes[0]
    assert head["requests"]["running"] == 1 and head["requests"]["queued"] == 0
    assert head["requests"]["tokens_per_s"] > 0 and head["load"] > 0, head
    shown = render(nodes)   # what `flowedge status` prints
    assert float(re.search(r"tokens/s (\S+)", shown).group(1)) > 0 and "running 1" in shown, shown
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["flowedge_head_tokens_per_second"].samples[0].value > 0
    assert families["flowedge_head_load"].samples[0].value > 0
    assert _stages_hold_nothing(stack)   # the stream left early: cancelled, KV freed


def test_litellm_maps_a_context_overflow_to_its_context_window_error(stack, monkeypatch):
    """Client libraries tell a context overflow by OpenAI's words; litellm raises its own error type on them."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of its price list
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{NAME}", api_base=stack["url"] + "/v1", api_key=KEY, num_retries=0,
                           messages=[{"role": "user", "content": PROMPT}], max_tokens=5000)
