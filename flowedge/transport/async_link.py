"""The link for asyncio code (the asyncio client, the HTTP front): a DEALER whose receive is awaited.

The nodes poll with deadlines (`link.py`); an asyncio client awaits instead, so it gets its own small
seam with the same vocabulary (frames in `Inbound`, `LinkError` once closed). Two implementations:
ZeroMQ's asyncio sockets (one context for every client of a process, the cluster's client keys), and a
wrapper over a memory link's DEALER for in-process clusters.
"""
from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from flowedge.errors import LinkError
from flowedge.transport.codec import Message
from flowedge.transport.link import Endpoint, Event, Inbound, Kind, PeerEvent
from flowedge.transport.memory_link import MemoryNetwork
from flowedge.transport.security import load_keys, secure_client, warn_insecure
from flowedge.transport.zmq_link import monitor_of


class AsyncDealer(ABC):
    """One connection to a ROUTER, awaited."""

    @abstractmethod
    async def send(self, msg: Message) -> None: ...

    @abstractmethod
    def send_nowait(self, msg: Message) -> None:
        """Send if it can go now (a Cancel on the way out); dropped otherwise."""

    @abstractmethod
    async def receive(self) -> Inbound | PeerEvent:
        """The next message or peer event; LinkError once the dealer is closed."""

    @abstractmethod
    def close(self) -> None: ...


class AsyncLink(ABC):
    @abstractmethod
    def dealer(self, address: str) -> AsyncDealer: ...

    @abstractmethod
    def close(self) -> None: ...


class ZmqAsyncDealer(AsyncDealer):
    """A zmq.asyncio DEALER and its socket monitor: a closed connection is a DISCONNECTED event at once (as
    the sync link's DEALER says), not only the head's heartbeats going quiet."""

    def __init__(self, sock: zmq.asyncio.Socket, address: str = "") -> None:
        self.sock, self.address = sock, address
        self.monitor = monitor_of(sock, zmq.EVENT_DISCONNECTED)
        self.poller = zmq.asyncio.Poller()
        for s in (self.sock, self.monitor):
            self.poller.register(s, zmq.POLLIN)

    async def send(self, msg: Message) -> None:
        try:
            await self.sock.send_multipart(msg.to_frames(), copy=False)
        except zmq.ZMQError as err:
            raise LinkError(f"dealer: {err}") from None

    def send_nowait(self, msg: Message) -> None:
        if not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart(msg.to_frames(), flags=zmq.NOBLOCK)

    async def receive(self) -> Inbound | PeerEvent:
        """Messages first (what came before the connection closed), then the monitor's DISCONNECTED."""
        try:
            while True:
                ready = dict(await self.poller.poll())
                if self.sock in ready:
                    return Inbound(await self.sock.recv_multipart(copy=False))
                if self.monitor in ready:
                    event = parse_monitor_message(await self.monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        return PeerEvent(Event.DISCONNECTED, detail=self.address)
        except zmq.ZMQError as err:
            raise LinkError(f"dealer: {err}") from None

    def close(self) -> None:
        self.monitor.close(0)
        self.sock.close(0)


class ZmqAsyncLink(AsyncLink):
    """DEALERs on one zmq.asyncio context, with the cluster's client keys unless `insecure`."""

    def __init__(self, keys_dir: Path | str | None = None, insecure: bool = False) -> None:
        if insecure:
            warn_insecure()
        self.keys = None if insecure else load_keys(keys_dir)
        self.ctx = zmq.asyncio.Context()

    def dealer(self, address: str) -> ZmqAsyncDealer:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        if self.keys is not None:
            secure_client(sock, self.keys)
        dealer = ZmqAsyncDealer(sock, address)   # its monitor before the connection: no event is missed
        sock.connect(address)
        return dealer

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class MemoryAsyncDealer(AsyncDealer):
    """A memory DEALER awaited from asyncio: its blocking receive runs in short slices off the loop."""

    SLICE_S = 0.05

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.closed = False

    async def send(self, msg: Message) -> None:
        self.endpoint.send(msg)

    def send_nowait(self, msg: Message) -> None:
        with contextlib.suppress(LinkError):
            self.endpoint.send(msg)

    async def receive(self) -> Inbound | PeerEvent:
        while not self.closed:
            got = await asyncio.to_thread(self.endpoint.receive, self.SLICE_S)
            if got is not None:
                return got
        raise LinkError("dealer closed")

    def close(self) -> None:
        self.closed = True
        self.endpoint.close()


class MemoryAsyncLink(AsyncLink):
    def __init__(self, net: MemoryNetwork) -> None:
        self.link = net.link()

    def dealer(self, address: str) -> MemoryAsyncDealer:
        return MemoryAsyncDealer(self.link.connect(Kind.DEALER, address))

    def close(self) -> None:
        self.link.close()
