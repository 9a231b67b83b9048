"""Run the HTTP API under uvicorn (what `flowedge http` calls)."""
from __future__ import annotations


import uvicorn

from flowedge.api.app import create_app
from flowedge.api.header_deadline import header_deadline_protocol
from flowedge.api.settings import ApiSettings, check_exposure


KEEP_ALIVE_S = 5
MAX_HEAD_BYTES = 16 * 1024   # request line + headers (h11's default, stated here on purpose)


def build_server(settings: ApiSettings, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for the API (refuses a non-loopback address without API keys). Slow clients are
    bounded in time by the header deadline (h11 with `header_timeout_s`) and the guard's body timeout, in
    size by `h11_max_incomplete_event_size` and the body limit, in number by `limit_concurrency`."""
    check_exposure(host, settings.api_keys)
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level=log_level,
                            http=header_deadline_protocol(settings.header_timeout_s),
                            timeout_keep_alive=KEEP_ALIVE_S, proxy_headers=False, server_header=False,
                            lifespan="on", h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            limit_concurrency=settings.max_connections)
    return uvicorn.Server(config)


