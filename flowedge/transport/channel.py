"""Thin socket helpers shared by head and stages: send/receive messages and the HELLO handshake.

Socket pattern: the head binds ROUTER sockets, stages and clients connect DEALER sockets. On a ROUTER
a message is [identity, *message frames] (no empty delimiter frame). Receivers never crash on peer
garbage: `decode` raises ProtocolError, the caller logs it and drops the message.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from flowedge.errors import ProtocolError, Refused
from flowedge.transport.buffers import frame_buffer
from flowedge.transport.protocol import Hello, Message, Refuse, Welcome, check_version, decode

log = logging.getLogger(__name__)

# ZMTP 3 framing: 1 flag byte + 1 length byte (body <= 255) or 8 length bytes.
_SHORT_FRAME_MAX = 255
# CurveZMQ wraps each frame in a MESSAGE command: "\x07MESSAGE" + 8-byte nonce + 1 flag byte + 16-byte MAC.
CURVE_FRAME_OVERHEAD = 8 + 8 + 1 + 16


def send_msg(sock: zmq.Socket, msg: Message) -> None:
    """Send a message zero-copy (tensor frames are not copied; do not mutate them afterwards)."""
    sock.send_multipart(msg.to_frames(), copy=False)


def send_routed(sock: zmq.Socket, identity: bytes, msg: Message) -> None:
    """Send a message from a ROUTER socket to the peer `identity`."""
    sock.send_multipart([identity, *msg.to_frames()], copy=False)


def recv_frames(sock: zmq.Socket, timeout_ms: int) -> list[zmq.Frame] | None:
    """The next multipart message as zero-copy frames, or None if none came within `timeout_ms`."""
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return sock.recv_multipart(copy=False)


def recv_msg(sock: zmq.Socket, timeout_ms: int) -> Message | None:
    """The next message, None on timeout; ProtocolError on a malformed one (log it and drop it)."""
    frames = recv_frames(sock, timeout_ms)
    return None if frames is None else decode(frames)


def recv_routed(sock: zmq.Socket, timeout_ms: int) -> tuple[bytes, list[zmq.Frame]] | None:
    """(peer identity, undecoded frames) from a ROUTER socket, or None on timeout."""
    frames = recv_frames(sock, timeout_ms)
    if frames is None:
        return None
    if len(frames) < 2:
        raise ProtocolError("routed message without a body")
    return frames[0].bytes, frames[1:]


def hello_exchange(sock: zmq.Socket, hello: Hello, timeout_ms: int) -> Welcome:
    """Client side of the handshake: send HELLO, return the WELCOME; ProtocolError if refused or silent."""
    send_msg(sock, hello)
    return check_welcome(recv_msg(sock, timeout_ms), timeout_ms / 1000)  # a major-version mismatch raises here


def check_welcome(reply: Message | None, timeout_s: float) -> Welcome:
    """The head's answer to a HELLO, or ProtocolError saying why there is none (refused, silent, odd)."""
    if reply is None:
        raise ProtocolError(
            f"no answer to HELLO within {round(timeout_s * 1000)} ms: is the head up, "
            "and does this node have the cluster's keys (or do both run --insecure)?"
        )
    if isinstance(reply, Refuse):
        raise Refused(f"refused by peer: {reply.reason}")
    if not isinstance(reply, Welcome):
        raise ProtocolError(f"expected WELCOME after HELLO, got {reply.TYPE}")
    check_version(reply.version)
    return reply


def judge_hello(frames: Sequence[Any], admit: Callable[[Hello], str | None] | None = None
                ) -> tuple[Hello | None, str | None]:
    """(the HELLO, None) to welcome, or (None, why) to refuse. `admit(hello)` may return a refusal reason
    (e.g. "a head is already connected")."""
    try:
        hello = decode(frames)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected HELLO first, got {hello.TYPE}")
        check_version(hello.version)
        reason = admit(hello) if admit is not None else None
    except ProtocolError as err:
        return None, str(err)
    return (hello, None) if reason is None else (None, reason)


def log_hello(identity: bytes, hello: Hello | None, reason: str | None) -> None:
    if hello is None:
        log.warning("refused peer %r: %s", identity, reason)
    else:
        (log.debug if hello.role == "client" else log.info)("welcomed %s %s (%s)", hello.role, hello.node_id,
                                                             hello.device)


def answer_hello(
    sock: zmq.Socket,
    identity: bytes,
    frames: Sequence[Any],
    welcome: Welcome,
    admit: Callable[[Hello], str | None] | None = None,
) -> Hello | None:
    """Server side (ROUTER): WELCOME a valid HELLO and return it, else REFUSE with the reason (logged)."""
    hello, reason = judge_hello(frames, admit)
    log_hello(identity, hello, reason)
    send_routed(sock, identity, welcome if reason is None else Refuse(reason=reason))
    return hello


def wire_bytes(frames: Sequence[Any], curve: bool = True) -> int:
    """Bytes a message occupies on a ZMTP 3 TCP stream (handshake excluded): bodies plus framing."""
    total = 0
    for frame in frames:
        body = len(frame_buffer(frame)) + (CURVE_FRAME_OVERHEAD if curve else 0)
        total += body + (2 if body <= _SHORT_FRAME_MAX else 9)
    return total
