"""Security headers on every HTTP response of `flowedge http`.

The dashboard is a page that holds an API key and draws what peers report: its Content-Security-Policy
allows scripts, styles and fetches from this origin only (no inline script or handler, so markup that
slipped into the page could not run), and no framing (`frame-ancestors 'none'`, and X-Frame-Options
for older browsers), so another site cannot overlay it to steal clicks. The JSON answers get the same
headers: they cost nothing and a browser that opens one directly treats it the same way.
"""
from __future__ import annotations

from starlette.datastructures import MutableHeaders

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                           "frame-ancestors 'none'")
HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    """ASGI middleware: adds HEADERS to every response start (the outermost one, so that the request
    guard's own refusals carry them too)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)   # Starlette's view, editing the message's list
                for name, value in HEADERS:
                    headers.setdefault(name.decode(), value.decode())
            await send(message)

        await self.app(scope, receive, with_headers)
