"""Run the HTTP API under uvicorn (what `flowedge http` calls)."""
from __future__ import annotations


import uvicorn

from flowedge.systemd.sd_notify import Notifier

from flowedge.api.admission import Admission
from flowedge.api.app import create_app
from flowedge.api.header_deadline import HeadMiddleware, HeadWatch
from flowedge.api.settings import MAX_HEAD_BYTES, ApiSettings, check_exposure


KEEP_ALIVE_S = 5


class NotifyingServer(uvicorn.Server):
    """uvicorn that tells systemd (Type=notify) it serves once its sockets listen, and when it stops."""

    def __init__(self, config: uvicorn.Config, notifier: Notifier | None = None) -> None:
        super().__init__(config)
        self.notifier = notifier or Notifier()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.notifier.ready(f"serving the API on {self.config.host}:{self.config.port}")

    async def shutdown(self, sockets=None) -> None:
        self.notifier.stopping()
        await super().shutdown(sockets)


def build_server(settings: ApiSettings, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for the API (refuses a non-loopback address without API keys). Slow and many
    clients are bounded by what uvicorn's `Config` offers: `h11_max_incomplete_event_size` (a head's
    bytes), `limit_concurrency` (connections and tasks; 503 beyond), `timeout_keep_alive` (idle time
    between requests); and by what it lacks, through its public seams: the head deadline (an `http=`
    protocol class wrapping uvicorn's, with an ASGI middleware: header_deadline.py) and the admission
    (connections without a complete head: per address and up to three quarters of the cap, the oldest
    closed first). The guard (a Starlette middleware) adds the body deadline, the head cap and the body limit."""
    check_exposure(host, settings.api_keys)
    admission = Admission(settings.max_connections_per_address,
                          max(1, settings.max_connections - settings.max_connections // 4))
    watch = HeadWatch(settings.header_timeout_s, admission)
    app = create_app(settings)
    app.add_middleware(HeadMiddleware, watch=watch)   # the outermost: it sees each request's head complete
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=watch.protocol_class(),
                            timeout_keep_alive=KEEP_ALIVE_S, proxy_headers=False, server_header=False,
                            lifespan="on", h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            limit_concurrency=settings.max_connections)
    return NotifyingServer(config)
