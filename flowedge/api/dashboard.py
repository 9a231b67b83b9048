"""The live dashboard of `flowedge http`: the page at `/`, its static files under `/dashboard/`, and
`/v1/status/stream`, the head's status as server-sent events, and `/v1/timeline`, the head's last minutes
(node/timeline.py), which the page fetches once when it opens so that it draws what came before.

The page and its files hold no cluster data, so they are served without an API key (a browser cannot
send one on navigation); the data comes only from `/v1/status/stream` and `/v1/chat/completions`, which
the page calls with the key the user typed (kept in the tab's sessionStorage), so the dashboard has
exactly the API's auth. The page draws every value as text, never as HTML (a node's row holds what a
peer reported), and its Content-Security-Policy (api/headers.py) runs no inline script. Everything is
plain HTML, CSS and JavaScript shipped in the package: no build step.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")
OPEN_PREFIX = "/dashboard/"
STREAM_PATH = "/v1/status/stream"
TIMELINE_PATH = "/v1/timeline"
INTERVAL_S = 0.5          # one status a half second: cheap for the head, smooth enough for a timeline


def is_open(path: str) -> bool:
    """Paths served without an API key: the page and its static files (no data in them)."""
    return path == "/" or path.startswith(OPEN_PREFIX)


async def status_events(fetch: Callable[[], Awaitable[list[dict] | None]],
                        interval_s: float = INTERVAL_S) -> AsyncIterator[bytes]:
    """The head's status every `interval_s` as SSE `data:` lines; `nodes` is null while the head does
    not answer (the page says so instead of freezing)."""
    while True:
        started = time.monotonic()
        nodes = await fetch()
        yield b"data: " + json.dumps({"t": round(time.time(), 3), "nodes": nodes}).encode() + b"\n\n"
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def timeline_of(head: dict) -> dict:
    """The head's recent past from its status row; an older head, which keeps none, has no samples."""
    past = head.get("timeline")
    if not isinstance(past, dict):
        return {"every_s": None, "span_s": 0, "fields": [], "stage_fields": [], "samples": []}
    return past


def mount(app: FastAPI) -> None:
    """The page at `/` and its files under `/dashboard/`."""
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"cache-control": "no-cache"})

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount(OPEN_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="dashboard")
