"""The load half of tools/soak.py: ZeroMQ and HTTP clients (whole and streaming answers, cancels, clients
that vanish mid-stream) at bounded concurrency and rate, every T=0 answer checked against the undisturbed
one for the same prompt and channel, and every outcome counted by kind."""
from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from flowedge.client.sync_client import Client
from flowedge.errors import FlowedgeError

log = logging.getLogger("soak")

PROMPTS = ("Once upon a time", "The capital of France is", "def fibonacci(n):", "Rain fell on the")
KINDS = ("zmq", "zmq-stream", "zmq-cancel", "http", "http-stream", "http-disconnect")
MAX_NEW = 24


@dataclass
class Tally:
    """What the load saw; one lock, since every worker thread writes here."""
    requests: Counter = field(default_factory=Counter)       # by kind
    failures: Counter = field(default_factory=Counter)       # by kind of failure
    wrong: list = field(default_factory=list)                 # how each wrong T=0 answer differed (`difference`)
    spurious_503: int = 0
    answered_ok: int = 0       # answered, and the same as the undisturbed answer (or cancelled as asked)
    clear_errors: int = 0      # ended with an error that says what happened
    lost: int = 0              # no answer in time, or the connection cut under it
    spurious_errors: int = 0   # clear errors while the head said ready and no fault was near
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str, lost: bool = False, spurious: bool = False) -> None:
        with self.lock:
            self.failures[what] += 1
            self.lost += lost
            self.clear_errors += not lost
            self.spurious_errors += spurious and not lost

    def answered(self) -> None:
        with self.lock:
            self.answered_ok += 1

    def line(self) -> str:
        return (f"{sum(self.requests.values())} sent, {self.answered_ok} right, {len(self.wrong)} wrong, "
                f"{self.clear_errors} clear errors, {self.lost} lost")

    def as_dict(self) -> dict:
        return {"requests": sum(self.requests.values()), "sent": sum(self.requests.values()),
                "by_kind": dict(self.requests), "answered_ok": self.answered_ok, "clear_errors": self.clear_errors,
                "lost": self.lost, "spurious_errors": self.spurious_errors,
                "failures": dict(self.failures), "wrong_at_t0": len(self.wrong), "wrong": self.wrong[:20],
                "spurious_503": self.spurious_503}


def is_lost(err: Exception) -> bool:
    """No answer at all (a timeout, a cut connection, anything unexpected), as against an error that says
    what went wrong."""
    if isinstance(err, FlowedgeError):
        return "no answer for" in str(err)
    return not isinstance(err, httpx.HTTPStatusError)


class Readiness:
    """The head's readiness polled every 0.5 s and the chaos events, so a 503 can be judged: spurious when
    the head said ready all through the request and nothing was disturbed meanwhile."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.unready: list[float] = []     # times the poll saw "not ready" (or no answer)
        self.events: list[float] = []      # times chaos hurt a node
        self.lock = threading.Lock()

    def poll(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            try:
                with Client(self.addr, timeout_s=2.0) as c:
                    ready = bool(c.status()[0].get("ready"))
            except FlowedgeError:
                ready = False
            if not ready:
                with self.lock:
                    self.unready.append(time.monotonic())

    def hurt(self) -> None:
        with self.lock:
            self.events.append(time.monotonic())

    def calm(self, t0: float, t1: float, margin_s: float = 1.0) -> bool:
        with self.lock:
            return not any(t0 - margin_s <= t <= t1 + margin_s for t in self.unready + self.events)


class Load:
    """`concurrency` workers, together at most `rate` requests a second."""

    def __init__(self, addr: str, http_base: str, tally: Tally, readiness: Readiness, *, concurrency: int,
                 rate: float, seed: int = 0) -> None:
        self.addr, self.base, self.tally, self.readiness = addr, http_base, tally, readiness
        self.concurrency, self.gap_s = concurrency, 1.0 / rate
        self.rng = random.Random(seed)
        self.next_at = time.monotonic()
        self.pace = threading.Lock()
        self.refs: dict[tuple[str, int], object] = {}
        self.t0 = time.monotonic()

    def references(self) -> None:
        """The undisturbed T=0 answers, taken before any chaos: token ids over ZeroMQ, text over HTTP."""
        for i, p in enumerate(PROMPTS):
            with Client(self.addr, timeout_s=120) as c:
                self.refs["zmq", i] = c.generate(p, max_new_tokens=MAX_NEW)["token_ids"]
            r = httpx.post(f"{self.base}/v1/completions", json=self._body(i, False), timeout=120)
            if r.status_code != 200:   # the body says why (an "internal error" names the exception)
                raise RuntimeError(f"the reference answer to prompt {i} over HTTP: {r.status_code} {r.text[:2000]}")
            self.refs["http", i] = r.json()["choices"][0]["text"]

    def run(self, stop: threading.Event) -> list[threading.Thread]:
        workers = [threading.Thread(target=self._worker, args=(stop, k), daemon=True)
                   for k in range(self.concurrency)]
        for w in workers:
            w.start()
        return workers

    def _worker(self, stop: threading.Event, k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            self._wait_turn()
            kind, i = rng.choice(KINDS), rng.randrange(len(PROMPTS))
            with self.tally.lock:
                self.tally.requests[kind] += 1
            t0 = time.monotonic()
            try:
                if getattr(self, "_" + kind.replace("-", "_"))(i):
                    self.tally.answered()
            except FlowedgeError as err:
                self._failed(f"{kind}: {_short(err)}", err, t0)
            except httpx.HTTPError as err:
                self._failed(f"{kind}: {type(err).__name__}", err, t0)
            except Exception as err:   # a soak counts whatever goes wrong and goes on
                log.exception("worker %d: %s", k, kind)
                self._failed(f"{kind}: {type(err).__name__}", err, t0)

    def _failed(self, what: str, err: Exception, t0: float) -> None:
        self.tally.fail(what, lost=is_lost(err), spurious=self.readiness.calm(t0, time.monotonic()))

    def _wait_turn(self) -> None:
        with self.pace:
            now = time.monotonic()
            self.next_at = max(self.next_at + self.gap_s, now)
            wait = self.next_at - now
        time.sleep(wait)

    def _check(self, kind: str, channel: str, i: int, got) -> bool:
        ref = self.refs[channel, i]
        if got == ref:
            return True
        seen = difference(kind, i, got, ref, time.monotonic() - self.t0)
        log.warning("wrong T=0 answer: %s", seen)
        with self.tally.lock:
            self.tally.wrong.append(seen)
        return False

    def _zmq(self, i: int) -> bool:
        with Client(self.addr, timeout_s=120) as c:
            return self._check("zmq", "zmq", i, c.generate(PROMPTS[i], max_new_tokens=MAX_NEW)["token_ids"])

    def _zmq_stream(self, i: int) -> bool:
        with Client(self.addr, timeout_s=120) as c:
            for _ in c.stream(PROMPTS[i], max_new_tokens=MAX_NEW):
                pass
            return self._check("zmq-stream", "zmq", i, c.last_result["token_ids"])

    def _zmq_cancel(self, i: int) -> bool:
        with Client(self.addr, timeout_s=120) as c:
            stream = c.stream(PROMPTS[i], max_new_tokens=MAX_NEW)
            next(stream, None)
            stream.close()   # sends Cancel
        return True

    def _body(self, i: int, stream: bool) -> dict:
        return {"prompt": PROMPTS[i], "max_tokens": MAX_NEW, "temperature": 0, "stream": stream}

    def _http(self, i: int) -> bool:
        t0 = time.monotonic()
        r = httpx.post(f"{self.base}/v1/completions", json=self._body(i, False), timeout=180)
        if self._refused("http", r, t0):
            return False
        return self._check("http", "http", i, r.json()["choices"][0]["text"])

    def _http_stream(self, i: int, leave: bool = False) -> bool:
        t0, text = time.monotonic(), []
        with httpx.stream("POST", f"{self.base}/v1/completions", json=self._body(i, True), timeout=180) as r:
            if self._refused("http-stream", r, t0):
                return False
            for line in r.iter_lines():
                if leave:
                    return True   # the connection closes under the answer
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:   # the stream ended with an error it names: a clear error
                        raise FlowedgeError(f"stream ended: {event['error'].get('message', '')}")
                    text += [c["text"] for c in event.get("choices", [])]
        return self._check("http-stream", "http", i, "".join(text))

    def _http_disconnect(self, i: int) -> bool:
        return self._http_stream(i, leave=True)

    def _refused(self, kind: str, r: httpx.Response, t0: float) -> bool:
        if r.status_code == 200:
            return False
        calm = self.readiness.calm(t0, time.monotonic())
        if r.status_code == 503 and calm:
            with self.tally.lock:
                self.tally.spurious_503 += 1
        r.read()
        self.tally.fail(f"{kind}: HTTP {r.status_code} {r.text[:80]}", spurious=calm)
        return True


def difference(kind: str, i: int, got, ref, at_s: float) -> dict:
    """Where a wrong answer left the reference (token ids or text), with a little of each side around it:
    enough to tell a gap, a repeat and a different continuation apart."""
    at = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    lo = max(0, at - 4)
    return {"kind": kind, "prompt": i, "at_s": round(at_s, 1), "first_difference": at, "got_len": len(got),
            "ref_len": len(ref), "got": got[lo:at + 8], "ref": ref[lo:at + 8],
            **({"got_whole": got, "ref_whole": ref} if max(len(got), len(ref)) <= 300 else {})}


def _short(err: Exception) -> str:
    """An error message without its numbers, so failures group by kind."""
    return "".join("#" if ch.isdigit() else ch for ch in str(err))[:100]
