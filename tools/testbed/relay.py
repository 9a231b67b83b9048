"""A userspace link impairer: an asyncio TCP relay that forwards each listener's connections to one target
and shapes every byte it carries by the directed link it crosses (no netem or iptables needed).

A link (sender device -> receiver device) has a `LinkShape`: one-way delay with uniform jitter, a bandwidth
enforced by a token bucket shared by every connection on that link, and occasional stalls standing in for
TCP retransmissions after a loss. Each chunk read from a socket (at most CHUNK_BYTES) waits for its tokens
(serialisation), then is delivered delay + jitter (+ a stall, with probability `stall_prob`) later, never
before the chunk ahead of it on the same connection (a TCP stream stays in order, so jitter only delays).
A bounded queue per direction pushes back on the sender once a link is full.

The testbed runs one relay process in its router namespace: every device reaches device j at j's virtual
address, the relay listens there, tells the sender from the connection's source address and forwards to j's
real address. Bytes j sends back on that connection cross the link j -> sender.

    python -m tools.testbed.relay SPEC.json        (SPEC: see `RelaySpec.from_dict`)

The loop uses `select()` rather than epoll: epoll's timeout has millisecond granularity, which would turn
a 0.3 ms LAN delay into 1 ms; select's is microseconds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("testbed.relay")

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 64            # chunks in flight per direction before the sender is pushed back
BURST_S = 0.001              # the token bucket holds this much transmit time (at least one chunk)
ANY = "*"                    # a sender not in the peers map
RT_PRIORITY = 10
STATS_FILE = "relay.stats.json"
LINK_FILE, LINK_ACK = "relay.link.json", "relay.link.ack"


@dataclass(frozen=True)
class LinkShape:
    """One directed link's impairments."""
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0   # 0 = unlimited
    stall_prob: float = 0.0       # per chunk
    stall_ms: float = 0.0

    def __post_init__(self) -> None:
        if min(self.delay_ms, self.jitter_ms, self.bandwidth_mbps, self.stall_prob, self.stall_ms) < 0:
            raise ValueError(f"link figures must be >= 0: {self}")
        if self.stall_prob > 1:
            raise ValueError(f"stall_prob is a probability, got {self.stall_prob}")

    def latency_s(self, rng: random.Random) -> float:
        """This chunk's one-way delay: delay +- jitter (uniform, never below 0), plus a stall now and then."""
        ms = max(0.0, self.delay_ms + rng.uniform(-self.jitter_ms, self.jitter_ms))
        if self.stall_prob and rng.random() < self.stall_prob:
            ms += self.stall_ms
        return ms / 1e3


class TokenBucket:
    """Bandwidth as a token bucket in bytes; `take` waits until the bytes may leave. Callers queue in order."""

    def __init__(self, bandwidth_mbps: float) -> None:
        self.rate_Bps = bandwidth_mbps * 1e6 / 8
        self.burst = max(CHUNK_BYTES, self.rate_Bps * BURST_S)
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, nbytes: int) -> None:
        if not self.rate_Bps:
            return
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate_Bps) - nbytes
            self.stamp = now
            if self.tokens < 0:   # in debt: wait until the bytes have left at the link's rate
                await asyncio.sleep(-self.tokens / self.rate_Bps)


@dataclass
class Link:
    """A directed link's live state: its shape, its bucket and its random stream."""
    shape: LinkShape
    rng: random.Random
    bucket: TokenBucket = field(init=False)
    bytes_moved: int = 0

    def __post_init__(self) -> None:
        self.bucket = TokenBucket(self.shape.bandwidth_mbps)


@dataclass(frozen=True)
class Route:
    """Listen at (listen_host, listen_port) for traffic to device `dst`; forward to (target_host, target_port)."""
    listen_host: str
    listen_port: int
    target_host: str
    target_port: int
    dst: str


@dataclass(frozen=True)
class RelaySpec:
    """Everything a relay process needs: its routes, the links' shapes by (src, dst), who a source address is."""
    routes: tuple[Route, ...]
    links: dict[tuple[str, str], LinkShape]
    peers: dict[str, str]                  # source IP -> device name
    default: LinkShape = LinkShape()       # a pair not in `links`
    seed: int = 0

    @staticmethod
    def from_dict(data: dict) -> "RelaySpec":
        """{"routes": [{listen_host, listen_port, target_host, target_port, dst}], "links": [{"src", "dst",
        **LinkShape}], "peers": {ip: name}, "default": {**LinkShape}, "seed": int}"""
        links = {(d["src"], d["dst"]): LinkShape(**{k: v for k, v in d.items() if k not in ("src", "dst")})
                 for d in data.get("links", [])}
        return RelaySpec(routes=tuple(Route(**r) for r in data["routes"]), links=links,
                         peers=dict(data.get("peers", {})), default=LinkShape(**data.get("default", {})),
                         seed=int(data.get("seed", 0)))

    def to_dict(self) -> dict:
        return {"routes": [as_dict(r) for r in self.routes],
                "links": [{"src": s, "dst": d, **as_dict(shape)} for (s, d), shape in self.links.items()],
                "peers": self.peers, "default": as_dict(self.default), "seed": self.seed}


def as_dict(obj) -> dict:
    """A dataclass's fields as a plain dict (for JSON)."""
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}


class Relay:
    """The relay's state: one `Link` per directed pair in use, its listening servers."""

    def __init__(self, spec: RelaySpec) -> None:
        self.spec = spec
        self.links: dict[tuple[str, str], Link] = {}
        self.servers: list[asyncio.base_events.Server] = []
        self.connections: set[asyncio.Task] = set()
        self.default = spec.default

    def link(self, src: str, dst: str) -> Link:
        key = (src, dst)
        if key not in self.links:
            shape = self.spec.links.get(key, self.default)
            self.links[key] = Link(shape, random.Random(f"{self.spec.seed}:{src}:{dst}"))
        return self.links[key]

    def set_default(self, shape: LinkShape) -> None:
        """Shape every link not named in the spec as `shape` from now on (connections already open too)."""
        self.default = shape
        for key, link in self.links.items():
            if key not in self.spec.links:
                link.shape, link.bucket = shape, TokenBucket(shape.bandwidth_mbps)

    async def start(self) -> None:
        for route in self.spec.routes:
            server = await asyncio.start_server(lambda r, w, route=route: self._serve(route, r, w),
                                                route.listen_host, route.listen_port)
            self.servers.append(server)
            log.info("relay %s:%d -> %s:%d (%s)", route.listen_host, route.listen_port, route.target_host,
                     route.target_port, route.dst)

    def moved(self) -> dict[str, int]:
        """Bytes delivered per directed link so far, as {"src>dst": bytes}."""
        return {f"{s}>{d}": link.bytes_moved for (s, d), link in sorted(self.links.items())}

    def ports(self) -> list[int]:
        """The ports listened on (a route's port 0 becomes a free one)."""
        return [s.sockets[0].getsockname()[1] for s in self.servers]

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        for server in self.servers:
            server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        for server in self.servers:
            await server.wait_closed()

    async def _serve(self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        src = self.spec.peers.get(writer.get_extra_info("peername")[0], ANY)
        try:
            up_r, up_w = await asyncio.open_connection(route.target_host, route.target_port)
        except OSError as err:
            log.info("relay to %s:%d refused: %s", route.target_host, route.target_port, err)
            writer.close()
            self.connections.discard(task)
            return
        try:
            await asyncio.gather(self._pipe(reader, up_w, self.link(src, route.dst)),
                                 self._pipe(up_r, writer, self.link(route.dst, src)))
        finally:
            writer.close()
            up_w.close()
            self.connections.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
        """One direction of one connection: read, pay the link's bandwidth, deliver after its latency."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        deliver = asyncio.create_task(self._deliver(queue, writer, link))
        last_at = 0.0
        try:
            try:
                while data := await reader.read(CHUNK_BYTES):
                    await link.bucket.take(len(data))
                    last_at = max(last_at, time.monotonic() + link.shape.latency_s(link.rng))
                    await queue.put((last_at, data))
            except (ConnectionError, OSError):
                pass
            await queue.put((last_at, b""))   # end of stream, after what is in flight
            await deliver
        finally:
            deliver.cancel()   # a no-op once it has finished; cancelled with us otherwise

    async def _deliver(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, link: Link) -> None:
        """Write each chunk when its time comes; after a write error keep taking chunks (and drop them) until
        the end of the stream, so the reader never blocks on a full queue."""
        broken = False
        while True:
            at, data = await queue.get()
            if not data:
                break
            if broken:
                continue
            if (wait_s := at - time.monotonic()) > 0:
                await asyncio.sleep(wait_s)
            try:
                writer.write(data)
                link.bytes_moved += len(data)
                await writer.drain()
            except (ConnectionError, OSError):
                broken = True
        try:
            if not broken and writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass


def precise_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers have microsecond resolution (see the module docstring)."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def reshape(relay: Relay, folder: Path) -> None:
    """SIGUSR1: apply the default shape in FOLDER/relay.link.json, then say so in FOLDER/relay.link.ack."""
    shape = LinkShape(**json.loads((folder / LINK_FILE).read_text()))
    relay.set_default(shape)
    (folder / LINK_ACK).write_text(json.dumps(as_dict(shape)) + "\n")
    log.info("links now %s", shape)


async def serve_forever(spec: RelaySpec, ready_file: Path | None = None) -> None:
    """Relay until SIGTERM/SIGINT; `ready_file` gets the ports once listening, and at the end, beside it,
    `relay.stats.json` the bytes each directed link carried. SIGUSR1 reshapes the links (`reshape`)."""
    relay = Relay(spec)
    await relay.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file is not None:
        loop.add_signal_handler(signal.SIGUSR1, reshape, relay, ready_file.parent)
        ready_file.write_text(json.dumps(relay.ports()) + "\n")   # last: the handlers are in place
    await stop.wait()
    if ready_file is not None:
        (ready_file.parent / STATS_FILE).write_text(json.dumps(relay.moved()) + "\n")
    await relay.close()


def realtime(priority: int = RT_PRIORITY) -> bool:
    """Run the relay under SCHED_FIFO: it stands for the network, whose timing must not wait for the box's
    CPU. On a loaded 2-core box a normal-priority relay woke 2-4 ms late (median), a FIFO one 0.1 ms.
    The relay moves bytes and sleeps, so it cannot starve the devices (and the kernel caps real-time
    tasks at sched_rt_runtime_us per second anyway)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        return True
    except (PermissionError, OSError) as err:
        log.warning("relay at normal priority (%s): its delays may run late on a busy machine", err)
        return False


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    realtime()
    spec = RelaySpec.from_dict(json.loads(Path(argv[0]).read_text()))
    ready = Path(argv[1]) if len(argv) > 1 else None
    loop = precise_loop()
    try:
        loop.run_until_complete(serve_forever(spec, ready))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
