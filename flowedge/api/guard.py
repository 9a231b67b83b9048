"""Bearer API keys, and the request guard in front of every route.

Every request but `/health` first passes its address's rate limit (`rate_limit.py`; 429 over it).
A request head over MAX_HEAD_BYTES is answered 431 however it arrived (h11 bounds only a head still
incomplete: one that came in a single read passed whole). The guard reads the whole body before the
app sees it: a Content-Length that is not a number, is larger than the limit, or promises bytes that
never come is answered 400/413 at once or once `read_timeout_s` has passed since the body was first
awaited — one deadline for the whole body, so a byte every few seconds does not hold the connection
for ever. The body is then replayed to the app; later `receive` calls go to the server, so a client
that disconnects mid-stream is still noticed.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streamed answers), built
on Starlette's parts: `Headers` reads the request's headers, `JSONResponse` sends each refusal. The
limits uvicorn itself offers are set in server.py; this covers what it does not (a whole-body deadline,
per-address rate, keys).
"""
from __future__ import annotations

import asyncio
import hmac
import time

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from flowedge.api.dashboard import is_open
from flowedge.api.rate_limit import RateLimit
from flowedge.api.settings import MAX_HEAD_BYTES, ApiSettings
from flowedge.errors import BodyRefused

OPEN_PATHS = ("/health",)   # for load balancers and systemd checks: tells only whether it serves


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_json(scope, receive, send, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
    """A refusal before the app: the error object, and the connection closed after it."""
    await JSONResponse(obj, status, headers={"connection": "close", **(headers or {})})(scope, receive, send)


def key_ok(header: str | None, api_keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header carries one of the keys (constant-time comparison)."""
    if not api_keys:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return any(hmac.compare_digest(token.strip().encode(), k.encode()) for k in api_keys)


def head_bytes(scope) -> int:
    """The request head's size as sent: request line, header lines and the blank line."""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 13
    return line + sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + 2


class RequestGuard:
    """ASGI middleware: API keys, then the body (see the module docstring)."""

    def __init__(self, app, settings: ApiSettings, on_refused=lambda status: None) -> None:
        self.app, self.settings, self.on_refused = app, settings, on_refused
        self.rate_limit = RateLimit(settings.requests_per_s_per_address, settings.request_burst_per_address)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if head_bytes(scope) > MAX_HEAD_BYTES:
            self.on_refused(431)
            return await send_json(scope, receive, send, 431, error_body(f"request head over {MAX_HEAD_BYTES} bytes"))
        if scope["path"] not in OPEN_PATHS:
            wait = self.rate_limit.admit((scope.get("client") or ("?",))[0], time.monotonic())
            if wait:
                self.on_refused(429)
                return await send_json(scope, receive, send, 429, error_body(
                    f"too many requests from this address: over {self.settings.requests_per_s_per_address:g}/s "
                    f"(burst {self.settings.request_burst_per_address}); retry in {wait:.1f} s",
                    kind="rate_limit_error", code="rate_limit_exceeded"),
                    {"retry-after": RateLimit.retry_after(wait)})
        headers = Headers(scope=scope)
        needs_key = scope["path"] not in OPEN_PATHS and not is_open(scope["path"])
        if needs_key and not key_ok(headers.get("authorization"), self.settings.api_keys):
            self.on_refused(401)
            return await send_json(scope, receive, send, 401, error_body(
                "missing or wrong API key: send `Authorization: Bearer KEY`", code="invalid_api_key"),
                {"www-authenticate": "Bearer"})
        refusal = self._check_length(headers.get("content-length"))
        if refusal is not None:
            self.on_refused(refusal[0])
            return await send_json(scope, receive, send, *refusal)
        try:
            body = await self._read_body(receive)
        except BodyRefused as err:
            self.on_refused(err.status)
            return await send_json(scope, receive, send, err.status, error_body(str(err)))
        if body is None:
            return   # the client left before sending its body
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check_length(self, value: str | None) -> tuple[int, dict] | None:
        if value is None:
            return None
        if not value.strip().isdigit():
            return 400, error_body(f"Content-Length must be a number of bytes, got {value[:40]!r}")
        if int(value) > self.settings.max_body_bytes:
            return 413, error_body(f"request body over {self.settings.max_body_bytes} bytes")
        return None

    async def _read_body(self, receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.read_timeout_s   # for the whole body, not each piece
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise BodyRefused(400, f"request body incomplete after {self.settings.read_timeout_s:g} s "
                                       f"(fewer bytes than its Content-Length?)") from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise BodyRefused(413, f"request body over {self.settings.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
