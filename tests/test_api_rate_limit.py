"""Per-address request rate: a flooding address gets 429 + Retry-After, others and /health are untouched."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings, strategies as st

from flowedge.api.guard import RequestGuard
from flowedge.api.rate_limit import RateLimit
from flowedge.api.settings import ApiSettings
from flowedge.errors import ConfigError


def test_a_burst_then_the_rate():
    limit = RateLimit(rate=2.0, burst=3)
    assert [limit.admit("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.admit("a", 0.0) == pytest.approx(0.5)      # empty: one token comes in 0.5 s
    assert limit.admit("b", 0.0) == 0.0                     # another address has its own bucket
    assert limit.admit("a", 0.5) == 0.0                     # refilled by then
    assert limit.admit("a", 0.5) > 0 and limit.refused == 2
    assert RateLimit.retry_after(0.01) == "1" and RateLimit.retry_after(2.2) == "3"


def test_off_and_bad_settings():
    assert all(RateLimit(rate=0, burst=1).admit("a", 0.0) == 0.0 for _ in range(100))
    with pytest.raises(ConfigError):
        RateLimit(rate=-1, burst=1)
    with pytest.raises(ConfigError):
        RateLimit(rate=1, burst=0)


def test_the_buckets_kept_are_bounded():
    limit = RateLimit(rate=1.0, burst=1, max_addresses=10)
    for i in range(1000):
        limit.admit(f"10.0.{i // 256}.{i % 256}", float(i))
    assert len(limit.buckets) == 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 5)), max_size=60))
def test_never_more_than_burst_plus_rate_times_time(events):
    """Whatever the arrival pattern: admitted requests from one address <= burst + rate * elapsed."""
    limit, now, admitted = RateLimit(rate=3.0, burst=4), 0.0, {"a": 0, "b": 0, "c": 0}
    for address, gap in events:
        now += gap
        if limit.admit(address, now) == 0.0:
            admitted[address] += 1
    assert all(n <= 4 + 3.0 * now + 1e-9 for n in admitted.values())


def _call(guard: RequestGuard, path: str, client: str) -> tuple[int, dict, dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "client": (client, 40000)}
    asyncio.run(guard(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body) if body else {}


def test_the_guard_answers_429_to_the_flooding_address_only():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    refused: list[int] = []
    guard = RequestGuard(app, ApiSettings(requests_per_s_per_address=0.01, request_burst_per_address=5),
                         on_refused=refused.append)
    statuses = [_call(guard, "/v1/models", "10.0.0.66")[0] for _ in range(8)]
    assert statuses == [200] * 5 + [429] * 3 and refused == [429] * 3
    status, headers, body = _call(guard, "/v1/models", "10.0.0.66")
    assert status == 429 and int(headers[b"retry-after"]) >= 1
    assert body["error"]["code"] == "rate_limit_exceeded" and "too many requests" in body["error"]["message"]
    assert _call(guard, "/v1/models", "10.0.0.7")[0] == 200        # another client is served
    assert _call(guard, "/health", "10.0.0.66")[0] == 200          # health checks are never limited
