"""The request guard's answers to bodies it will not read: 413 over the limit, 400 when the body stops
short, each counted under its status (the status travels in the error's type, BodyRefused)."""
from __future__ import annotations

import asyncio
import json

from flowedge.api.guard import RequestGuard
from flowedge.api.settings import ApiSettings


async def _app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


def _post(settings: ApiSettings, pieces: list[bytes], then_wait: bool) -> tuple[int, str, list[int]]:
    """POST a body sent in `pieces` (no Content-Length); `then_wait`: the last piece never comes."""
    sent: list[dict] = []
    refused: list[int] = []
    queue = [{"type": "http.request", "body": b, "more_body": True} for b in pieces]

    async def receive():
        if queue:
            return queue.pop(0)
        if then_wait:
            await asyncio.sleep(60)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [], "client": ("10.0.0.1", 40000)}
    asyncio.run(RequestGuard(_app, settings, on_refused=refused.append)(scope, receive, send))
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]) or b"{}")
    return sent[0]["status"], body.get("error", {}).get("message", ""), refused


def test_a_body_over_the_limit_is_413_and_one_that_stops_short_is_400():
    settings = ApiSettings(max_body_bytes=100, read_timeout_s=0.2)
    assert _post(settings, [b"x" * 60], then_wait=False)[0] == 200
    status, message, refused = _post(settings, [b"x" * 60, b"x" * 60], then_wait=False)
    assert (status, refused) == (413, [413]) and "over 100 bytes" in message
    status, message, refused = _post(settings, [b"x" * 10], then_wait=True)
    assert (status, refused) == (400, [400]) and "incomplete after 0.2 s" in message
