"""Run the HTTP API under uvicorn (what `flowedge http` calls)."""
from __future__ import annotations


import uvicorn

from flowedge.api.app import create_app
from flowedge.api.settings import ApiSettings, check_exposure


KEEP_ALIVE_S = 5


def build_server(settings: ApiSettings, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for the API (refuses a non-loopback address without API keys)."""
    check_exposure(host, settings.api_keys)
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level=log_level, http="h11",
                            timeout_keep_alive=KEEP_ALIVE_S, proxy_headers=False, server_header=False,
                            lifespan="on")
    return uvicorn.Server(config)


