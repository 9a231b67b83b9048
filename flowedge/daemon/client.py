"""The client side: stream an answer from a running head, ask for status, or stop the cluster.

Embedding in a gateway app:

    from flowedge import Client
    client = Client("127.0.0.1:5555")
    for piece in client.stream("Write a haiku about routers"):
        print(piece, end="", flush=True)
    print(client.last_result["tokens_per_s"])
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import zmq

from flowedge.daemon.config import DEFAULT_PORT, flowedge_home, split_addr, tcp
from flowedge.errors import FlowedgeError, ProtocolError, RequestFailed, refusal
from flowedge.transport import protocol as proto
from flowedge.transport.channel import hello_exchange, recv_msg, send_msg
from flowedge.transport.security import Security

log = logging.getLogger(__name__)

# A head answers HELLO from its event loop at once; silence this long means no head there. Short, so
# a wrong or dead address is reported in seconds (waiting for a head that is still starting is
# `wait_ready`'s job, which tries again).
HELLO_TIMEOUT_S = 2.0


__all__ = ["Client", "RequestFailed", "Answer", "prompt_request", "send_cancel", "wait_ready"]


class Client:
    """A connection to a head. Not thread-safe: one per thread.

    Liveness (Paranoid Pirate): while a request is in progress the head heartbeats this client, which
    answers each heartbeat (so the head drops the request of a client that went away). A closed
    connection to the head (the socket monitor) raises FlowedgeError at once, and so does
    `head_timeout_s` without a word from the head while a request is in progress; `timeout_s` bounds
    the wait for any answer. Closing the client (or the stream) mid-answer cancels the request."""

    def __init__(self, addr: str = f"127.0.0.1:{DEFAULT_PORT}", *, keys_dir: str | Path | None = None,
                 insecure: bool = False, timeout_s: float = 300.0, head_timeout_s: float = 5.0) -> None:
        self.addr = addr
        self.timeout_ms = int(timeout_s * 1000)
        self.head_timeout_s = head_timeout_s
        host, port = split_addr(addr)
        self.ctx = zmq.Context()
        self.security = Security.start(self.ctx, keys_dir or flowedge_home() / "keys", insecure)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.security.client(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(tcp(host, port))
        self._ids = itertools.count(1)
        self._welcomed = False
        self.in_flight: int | None = None   # the request being streamed
        self.last_result: dict | None = None

    def close(self) -> None:
        self.cancel()
        self.monitor.close(0)
        self.sock.close(0)
        self.security.stop()
        self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hello(self) -> None:
        if not self._welcomed:
            hello = proto.Hello(node_id=f"client-{os.getpid()}", role="client", device="client",
                                free_memory_bytes=0, capabilities={"heartbeat": True})
            try:
                hello_exchange(self.sock, hello, min(self.timeout_ms, int(HELLO_TIMEOUT_S * 1000)))
            except ProtocolError as err:
                raise FlowedgeError(f"cannot reach a flowedge head at {self.addr}: {err}") from None
            self._welcomed = True
            while self.monitor.poll(0):   # disconnects from before the handshake are no news
                self.monitor.recv_multipart()

    def _recv(self) -> proto.Message:
        """The next answer; head heartbeats are answered here, not returned."""
        start = last_word = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            now = time.monotonic()
            if now - start > self.timeout_ms / 1000:
                raise FlowedgeError(f"the head at {self.addr} gave no answer for {self.timeout_ms / 1000:.0f} s")
            if self.in_flight is not None and now - last_word > self.head_timeout_s:
                raise FlowedgeError(f"the head at {self.addr} went silent for {now - last_word:.1f} s")
            ready = dict(poller.poll(100))
            if self.sock in ready:
                msg = recv_msg(self.sock, 0)
                last_word = time.monotonic()
                if not isinstance(msg, proto.Heartbeat):
                    return msg
                if self.in_flight is not None:
                    send_msg(self.sock, proto.Heartbeat(node_id=f"client-{os.getpid()}", load=0.0, rss_bytes=0))
            elif self.monitor in ready:
                self.monitor.recv_multipart()
                self._welcomed = False
                raise FlowedgeError(f"lost the connection to the head at {self.addr} (did it stop or restart?)")

    def cancel(self) -> None:
        """Drop the request being streamed: the head frees its KV cache on every stage."""
        if self.in_flight is not None:
            send_cancel(self.sock, self.in_flight)
        self.in_flight = None

    # ---- requests -------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               system: str | None = None, stop: list[str] | str | None = None, raw: bool = False,
               max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, strategy: str = "") -> Iterator[str]:
        """Yield text pieces as the head accepts tokens; afterwards `last_result` holds the totals.

        `prompt` is a user turn (through the chat template) or, with `raw`, the model's text as is;
        `messages` a whole conversation; `system` a system turn before either; `stop` strings end the
        answer (cut off). Leaving the loop early cancels the request at the head."""
        request = prompt_request(next(self._ids), prompt, messages=messages, system=system, stop=stop, raw=raw,
                                 max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, strategy=strategy)   # a bad one is refused here
        rid = request.request_id
        self._hello()
        send_msg(self.sock, request)
        answer = Answer()
        self.in_flight = rid
        try:
            while not answer.done:
                msg = self._recv()
                piece = answer.take(msg, rid)
                if piece:
                    yield piece
        finally:
            if answer.done:
                self.in_flight = None
            else:
                self.cancel()
        self.last_result = answer.result

    def generate(self, prompt: str | list[int] | None = None, **kwargs) -> dict:
        """The whole answer at once (same keys as `flowedge generate --json`, plus wall-clock figures)."""
        for _ in self.stream(prompt, **kwargs):
            pass
        return dict(self.last_result)

    def status(self) -> list[dict]:
        self._hello()
        send_msg(self.sock, proto.StatusRequest())
        while True:
            msg = self._recv()
            if isinstance(msg, proto.StatusReply):
                return msg.nodes

    def shutdown(self, reason: str = "") -> None:
        """Ask the head to stop itself and every stage."""
        self._hello()
        send_msg(self.sock, proto.Shutdown(reason=reason))
        time.sleep(0.1)


def prompt_request(rid: int, prompt: str | list[int] | None, *, messages: list[dict] | None = None,
                   system: str | None = None, stop: list[str] | str | None = None, raw: bool = False,
                   max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | None = None, strategy: str = "") -> proto.PromptRequest:
    """The PromptRequest for one call of `stream` (shared by Client and AsyncClient); ProtocolError on
    a request that cannot be sent (the message validates itself)."""
    if (prompt is None) == (messages is None):
        raise FlowedgeError("give exactly one of a prompt or messages")
    if raw and (messages is not None or system is not None):
        raise FlowedgeError("raw mode sends the prompt as is: no messages, no system prompt")
    text, ids = (prompt, None) if isinstance(prompt, str) or prompt is None else (None, list(prompt))
    if system is not None:
        if ids is not None:
            raise FlowedgeError("a system prompt needs a text prompt or messages, not token ids")
        turns = list(messages) if messages is not None else [{"role": "user", "content": text}]
        messages, text = [{"role": "system", "content": system}, *turns], None
    return proto.PromptRequest(
        request_id=rid, max_new_tokens=max_new_tokens, text=text, token_ids=ids, messages=messages,
        stop=[stop] if isinstance(stop, str) else list(stop or ()), raw=raw, temperature=temperature,
        top_k=top_k or None, top_p=top_p if top_p not in (None, 1.0) else None, seed=seed, strategy=strategy)


def send_cancel(sock: zmq.Socket, request_id: int) -> None:
    """Ask the head to drop `request_id` without waiting (both clients); a closed socket or a gone head
    means there is nothing left to cancel."""
    if sock.closed:
        return
    try:
        sock.send_multipart(proto.Cancel(request_id=request_id).to_frames(), flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


class Answer:
    """One request's replies folded into pieces and totals (the same for both clients)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.first_token_s: float | None = None
        self.done = False
        self.result: dict | None = None

    def take(self, msg: proto.Message, rid: int) -> str:
        """The text piece `msg` adds ("" if none); RequestFailed (ContextOverflow where it applies) for
        the head's error reply."""
        if getattr(msg, "request_id", rid) != rid:
            return ""   # a late reply to an earlier, abandoned request
        if isinstance(msg, proto.ErrorReply):
            self.done = True
            raise refusal(msg.message)
        if not isinstance(msg, proto.TokenChunk):
            return ""
        self.tokens += msg.token_ids
        if msg.token_ids and self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.t0
        if msg.text:
            self.pieces.append(msg.text)
        if msg.done:
            self.done = True
            wall = time.monotonic() - self.t0
            self.result = {
                **(msg.stats or {}), "text": "".join(self.pieces), "token_ids": self.tokens,
                "client_wall_s": round(wall, 4),
                "wall_tokens_per_s": round(len(self.tokens) / wall, 3) if wall > 0 else None,
                "first_token_s": round(self.first_token_s, 4) if self.first_token_s is not None else None,
            }
        return msg.text


def wait_ready(addr: str, timeout_s: float, *, keys_dir=None, insecure: bool = False,
               progress=None, alive=lambda: True, why=lambda: "") -> list[dict]:
    """Poll a head's status until every stage is ready; FlowedgeError on timeout or if `alive()` fails.

    Each try uses a fresh connection, so replies queued behind a head that is still loading its
    models can never be mistaken for the answer to a later try."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise FlowedgeError(why() or "a cluster process exited before the cluster became ready (see its log)")
        client = Client(addr, keys_dir=keys_dir, insecure=insecure, timeout_s=1.0)  # bad keys raise here
        try:
            nodes = client.status()
        except FlowedgeError:
            line = "waiting for the head (loading models)"
        else:
            if nodes and nodes[0].get("ready"):
                return nodes
            ready = sum(1 for n in nodes[1:] if n.get("ready"))
            line = f"{ready}/{len(nodes) - 1} stages ready"
        finally:
            client.close()
        if progress and line != last:
            progress(line)
            last = line
        time.sleep(0.5)
    raise FlowedgeError(f"the cluster at {addr} was not ready within {timeout_s:.0f} s")
