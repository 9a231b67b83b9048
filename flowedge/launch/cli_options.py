"""Command-line options shared by the node commands (`serve`, `join`, `up`, `prompt`, `status`) and the HTTP
front (`flowedge http`), so that each is spelled and documented once."""
from __future__ import annotations

import logging

import click

from flowedge.transport.addresses import DEFAULT_PORT

HEAD_OPTION = click.option("--head", "head", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True,
                           help="The head's HOST:PORT (or a head and its standbys: A,B).")
KEYS_OPTION = click.option("--keys", "keys_dir", default=None, help="Cluster keys directory "
                           "(default $FLOWEDGE_HOME/keys).")
INSECURE_OPTION = click.option("--insecure", is_flag=True, help="No CurveZMQ (lab use only; logs a warning).")


def liveness_options(head: bool):
    """--heartbeat-ms and --stage-timeout (every node); the head's request deadlines too."""
    opts = [click.option("--heartbeat-ms", type=int, default=None,
                         help="Heartbeat period, both ways (default 500)."),
            click.option("--stage-timeout", type=float, default=None,
                         help="Seconds of silence before a peer (stage, or the head seen from a stage) is dead "
                              "(default 2 = 4 heartbeats).")]
    if head:
        opts += [click.option("--client-timeout", type=float, default=None,
                              help="Seconds of silence before a client with a request in progress has left (10)."),
                 click.option("--recovery", type=float, default=None,
                              help="Seconds a request waits for a lost stage's slot to be filled (30)."),
                 click.option("--stall-timeout", type=float, default=None,
                              help="Seconds without pipeline output before a request is replayed (120)."),
                 click.option("--max-concurrent", type=int, default=None,
                              help="Requests in the pipeline at once, batched on every stage (4); the rest queue."),
                 click.option("--kv-budget-tokens", type=int, default=None,
                              help="KV tokens each stage holds for all its requests (default 0: from each "
                                   "stage's free memory); a request waits until it fits.")]

    def apply(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn
    return apply


def daemon_logging() -> None:
    """Long-running processes (nodes, the HTTP front) log at INFO unless -v/-vv asked for more."""
    root = logging.getLogger()
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)
