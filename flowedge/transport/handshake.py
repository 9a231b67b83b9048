"""The versioned HELLO handshake over any link (channel.py holds the rules; this is the link's side)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flowedge.transport.channel import check_welcome, judge_hello, log_hello
from flowedge.transport.codec import decode
from flowedge.transport.link import Endpoint, Inbound
from flowedge.transport.protocol import Hello, Refuse, Welcome


def hello_exchange(endpoint: Endpoint, hello: Hello, timeout_s: float) -> Welcome:
    """A DEALER's side: send HELLO, return the WELCOME; ProtocolError if refused, silent or odd."""
    endpoint.send(hello)
    return welcome_from(endpoint.next_message(timeout_s), timeout_s)


def welcome_from(got: Inbound | None, timeout_s: float) -> Welcome:
    """The answer to a HELLO as a WELCOME; ProtocolError for a refusal, an odd answer or none (None) within
    `timeout_s` (for a DEALER that waits its own way)."""
    return check_welcome(None if got is None else decode(got.frames), timeout_s)


def answer_hello(endpoint: Endpoint, identity: bytes, frames: Sequence[Any], welcome: Welcome,
                 admit: Callable[[Hello], str | None] | None = None) -> Hello | None:
    """A ROUTER's side: WELCOME a valid HELLO and return it, else REFUSE with the reason (logged).
    PeerUnreachable if the peer hung up before the answer."""
    hello, reason = judge_hello(frames, admit)
    log_hello(identity, hello, reason)
    endpoint.send(welcome if reason is None else Refuse(reason=reason), identity)
    return hello
