"""`flowedge http` (wired into the CLI by flowedge/cli.py): the API server's flags, and its exit status."""
from __future__ import annotations

import logging
import sys
import threading

import click

from flowedge.errors import ConfigError
from flowedge.launch.cli_options import HEAD_OPTION, INSECURE_OPTION, KEYS_OPTION
from flowedge.launch.cli_options import daemon_logging
from flowedge.transport.addresses import split_addr

EX_CONFIG = 78   # sysexits.h: what systemd units are told not to restart on
HEAD_CHECK_S = 5.0   # the start-up look at the head: a status request's wait

log = logging.getLogger("flowedge")


@click.command("http")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, help="HOST:PORT for the HTTP API.")
@HEAD_OPTION
@click.option("--api-key", "api_keys", multiple=True,
              help="A bearer key clients must send (repeatable; also FLOWEDGE_API_KEYS=k1,k2). Required "
                   "whenever --listen is not a loopback address.")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False),
              help="A file of API keys, one a line.")
@click.option("--read-timeout", default=10.0, show_default=True, type=float,
              help="Seconds a client has to send a whole request body (one deadline, not per piece).")
@click.option("--request-timeout", default=300.0, show_default=True, type=float,
              help="Seconds of silence from the head before an answer fails.")
@click.option("--header-timeout", default=10.0, show_default=True, type=float,
              help="Seconds a client has to send a whole request head (request line + headers).")
@click.option("--max-connections", default=128, show_default=True, type=int,
              help="Open connections + running requests; beyond it new ones get 503.")
@click.option("--max-connections-per-address", default=16, show_default=True, type=int,
              help="Connections one client address may hold without a complete request head; past it its "
                   "oldest such connection is closed (three quarters of --max-connections in all).")
@click.option("--max-requests-per-s", default=20.0, show_default=True, type=float,
              help="Requests a second one client address may send (after a burst of twice that); past it 429. "
                   "0: no limit. /health is never limited.")
@KEYS_OPTION
@INSECURE_OPTION
def http(listen, head, api_keys, api_key_file, read_timeout, request_timeout, header_timeout, max_connections,
         max_connections_per_address, max_requests_per_s, keys_dir, insecure) -> None:
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics) in front of a head. A configuration error exits with status 78 (EX_CONFIG)."""
    daemon_logging()
    try:
        _serve_http(listen, head, api_keys, api_key_file, keys_dir, insecure, read_timeout_s=read_timeout,
                    request_timeout_s=request_timeout, header_timeout_s=header_timeout,
                    max_connections=max_connections, max_connections_per_address=max_connections_per_address,
                    requests_per_s_per_address=max_requests_per_s,
                    request_burst_per_address=max(1, round(2 * max_requests_per_s)))
    except ConfigError as err:   # EX_CONFIG: the unit's RestartPreventExitStatus=78, no restart loop
        click.echo(f"error: {err}", err=True)
        sys.exit(EX_CONFIG)


def _serve_http(listen, head, api_keys, api_key_file, keys_dir, insecure, **limits) -> None:
    """`limits`: ApiSettings fields (timeouts, connection and request-rate caps)."""
    from flowedge.allocator import HeapTrimmer, limit_arenas
    from flowedge.api.clients import key_client
    from flowedge.api.settings import ApiSettings, load_api_keys, split_listen

    limit_arenas()
    host, port = split_listen(listen)
    for addr in head.split(","):   # a head and its standbys, A,B: the client follows the head that answers
        split_addr(addr)   # a URL or a typo is one line now, not a server that answers 500 to everything
    settings = ApiSettings(head=head, keys_dir=keys_dir, insecure=insecure,
                           api_keys=load_api_keys(api_keys, api_key_file), **limits)
    from flowedge.api.server import build_server

    HeapTrimmer(threading.Event()).start()   # a daemon thread: ends with the process

    server = build_server(settings, host, port)
    for i, key in enumerate(settings.api_keys, 1):   # the names `client_weights` (the head's config) takes
        log.info("API key %d of %d: client %s at the head", i, len(settings.api_keys), key_client(key))
    log.info("OpenAI-compatible API on http://%s/v1 for the head at %s (%s)", listen, head,
             f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no API key: loopback only")
    threading.Thread(target=say_how_the_head_is, args=(head, keys_dir, insecure), name="head-check",
                     daemon=True).start()   # beside the server's start, not before it: it may take seconds
    server.run()
    if not server.started:
        raise ConfigError(f"cannot listen on {listen} (see the log above)")


def say_how_the_head_is(head: str, keys_dir: str | None, insecure: bool) -> None:
    """Warn at start when the head does not answer (or its cluster is not ready): every request would
    get 503 until it does, and the operator should know why from the first line, not the first request."""
    from flowedge.client.sync_client import Client
    from flowedge.errors import FlowedgeError

    try:
        with Client(head, keys_dir=keys_dir, insecure=insecure, timeout_s=HEAD_CHECK_S) as client:
            nodes = client.status()
    except FlowedgeError as err:
        log.warning("the head at %s is unreachable: %s; requests get 503 until it answers", head, err)
        return
    missing = [f"stage {n.get('stage')}" for n in nodes[1:] if n.get("role") == "stage" and not n.get("ready")]
    if nodes and not nodes[0].get("ready"):
        log.warning("the head at %s answers, but its cluster is not ready (waiting for %s); requests get 503 "
                    "until it is", head, ", ".join(missing) or "its stages")
    else:
        log.info("the head at %s answers and its cluster is ready", head)
