"""Whom an HTTP request is for, as the head's fair queue names it, and its answer when that client's queue is full.

The HTTP API asks the head on behalf of many callers over one process's connections, so it names the caller
in each PromptRequest (`client`): the head keeps one lane per client, starts them in turn and caps each one
(`max_queued_per_client`; engine/fair_queue.py). The name is the API key's, when keys are in use: `http:key-`
and the first 12 hex digits of its sha256 (never the key itself: the name shows in `flowedge status` and the
head's log); without keys (loopback), the client's address: `http:addr-127.0.0.1`. The head's
`client_weights` gives a named client more (or fewer) starts per round.
"""
from __future__ import annotations

import hashlib

from flowedge.errors import ApiError, Busy

PREFIX = "http:"
RETRY_AFTER_S = 2   # what a client told "busy" is asked to wait: a queue of 32 moves on within seconds


def key_client(key: str) -> str:
    """The head's name for the callers of one API key."""
    return f"{PREFIX}key-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def client_name(authorization: str | None, address: str, api_keys: tuple[str, ...]) -> str:
    """The client of a request the guard let through: its API key's name, else its address."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if api_keys and scheme.lower() == "bearer" and token in api_keys:
        return key_client(token)
    return f"{PREFIX}addr-{address}"


def busy(err: Busy) -> ApiError:
    """The head's `Busy` as OpenAI's 429: the caller has as many requests waiting as it may."""
    text = str(err).removeprefix(Busy.PREFIX)
    return ApiError(429, f"too many requests waiting for this client: {text}", "rate_limit_error", "rate_limited",
                    code="queue_full")
