"""Head failover drill on real processes: a head, a standby head and two stages (tiny pair by default);
clients stream answers through both head addresses, the head is kill -9'ed mid-answer, and the drill
measures how soon the standby serves and checks every answer against plain one-process greedy decoding.

    python tools/head_failover.py                          # tiny pair in a temporary home, 4 clients
    python tools/head_failover.py --clients 4 --max-new 160 --repeat 3 --json failover.json

Figures (one run): `takeover_s` kill -> the standby's status says ready (its stages rejoined), polled every
0.05 s from outside; `first_token_s` kill -> the first token any client got from the new head;
`answered`/`identical`/`errors`/`lost` over the clients (an error must name the failover; lost = neither).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowedge.client.async_client import AsyncClient
from flowedge.client.sync_client import Client, wait_ready
from flowedge.core.sampling import SamplingParams
from flowedge.errors import FlowedgeError

log = logging.getLogger("head-failover")

LAYERS = [2, 2]   # the tiny base's 4 layers over two stages: fixed, so head and standby plan alike


@dataclass
class Asker:
    """One client streaming one answer through every head address, in a thread."""
    heads: str
    prompt: list[int]
    max_new: int
    strategy: str
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    first: threading.Event = field(default_factory=threading.Event)
    use_async: bool = False   # the asyncio client (the HTTP front's) instead of the sync one

    def run(self) -> None:
        try:
            if self.use_async:
                asyncio.run(self._run_async())
            else:
                with Client(self.heads, timeout_s=120, failover_s=30) as c:
                    for chunk in c.chunks(self.prompt, max_new_tokens=self.max_new, strategy=self.strategy):
                        self._took(chunk.token_ids)
            self.done = True
        except FlowedgeError as err:
            self.error = str(err)
        finally:
            self.first.set()

    async def _run_async(self) -> None:
        async with AsyncClient(self.heads, timeout_s=120, failover_s=30) as c:
            async for chunk in c.chunks(self.prompt, max_new_tokens=self.max_new, strategy=self.strategy):
                self._took(chunk.token_ids)

    def _took(self, token_ids) -> None:
        self.tokens += token_ids
        self.times.append(time.monotonic())
        if len(self.tokens) >= 8:   # well into its answer when the head is killed
            self.first.set()


def prompts(n: int) -> list[list[int]]:
    """Byte-token prompts (no eos / bos), different per client."""
    return [[97 + (i * (k + 3) + k) % 26 for i in range(12 + 3 * k)] for k in range(n)]


def references(base: Path, ps: list[list[int]], max_new: int) -> list[list[int]]:
    from flowedge.engine.local import generate_ar

    return [generate_ar(base, p, max_new, SamplingParams()).token_ids for p in ps]


def _config(path: Path, **values) -> Path:
    lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")   # JSON scalars and lists are TOML too
    return path


class Nodes:
    """The four processes, each logging to run_dir/<name>.log."""

    def __init__(self, base: Path, draft: Path, run_dir: Path, port: int, strategy: str) -> None:
        self.run_dir, self.a, self.b = run_dir, f"127.0.0.1:{port}", f"127.0.0.1:{port + 2}"
        common = dict(model=str(base), draft=str(draft), stages=2, layers=LAYERS, strategy=strategy,
                      wire_dtype="float32", quant="none", draft_quant="none", heartbeat_ms=100, stage_timeout_s=1.0,
                      client_timeout_s=5.0, discovery=False, threads=1, max_concurrent=4)
        head = _config(run_dir / "head.toml", role="head", head=self.a, node_id="head", **common)
        standby = _config(run_dir / "standby.toml", role="standby", head=self.a, listen=self.b, node_id="standby",
                          failover_s=1.0, **common)
        base_cmd = [sys.executable, "-m", "flowedge", "-v"]
        self.commands = {"head": base_cmd + ["serve", "--config", str(head)],
                         "standby": base_cmd + ["join", self.a, "--config", str(standby), "--standby"]}
        for k in (1, 2):
            self.commands[f"stage-{k}"] = base_cmd + [
                "join", "--heads", f"{self.a},{self.b}", "--node-id", f"stage-{k}", "--stage", str(k), "--threads",
                "1", "--same-host", "--stage-timeout=1.0", "--heartbeat-ms=100"]
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.run_dir / f"{name}.log", "ab") as logf:
            self.procs[name] = subprocess.Popen(self.commands[name], stdout=logf, stderr=subprocess.STDOUT, env=env,
                                                stdin=subprocess.DEVNULL)

    def log_text(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def logs(self) -> str:
        return "\n".join(f"== {n}\n{self.log_text(n)[-4000:]}" for n in self.commands)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_for(cond, timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every_s)
    return False


def up(nodes: Nodes) -> None:
    """Head, standby (following), stages; ready when the head says so and the standby follows it."""
    for name in nodes.commands:
        nodes.start(name)
    wait_ready(nodes.a, 240, alive=lambda: all(p.poll() is None for p in nodes.procs.values()))
    if not wait_for(lambda: "standby: following head" in nodes.log_text("standby"), 120):
        raise FlowedgeError("the standby never followed the head:\n" + nodes.logs())


def serving(addr: str) -> bool:
    try:
        with Client(addr, timeout_s=1.0) as c:
            return bool(c.status()[0].get("ready"))
    except FlowedgeError:
        return False


def drill(nodes: Nodes, refs: list[list[int]], ps: list[list[int]], max_new: int, strategy: str) -> dict:
    """One kill -9 of the head under len(ps) clients; the figures."""
    askers = [Asker(f"{nodes.a},{nodes.b}", p, max_new, strategy, use_async=k == len(ps) - 1 and k > 0)
              for k, p in enumerate(ps)]   # the last one on the asyncio client, as the HTTP front
    threads = [threading.Thread(target=a.run, daemon=True) for a in askers]
    for t in threads:
        t.start()
    for a in askers:
        a.first.wait(120)
    killed_at = time.monotonic()
    nodes.procs["head"].send_signal(signal.SIGKILL)
    nodes.procs["head"].wait()
    up_in = wait_for(lambda: serving(nodes.b), 60, 0.05)
    takeover_s = time.monotonic() - killed_at if up_in else None
    for t in threads:
        t.join(180)
    after = [t for a in askers for t in a.times if t > killed_at + 0.05]
    verdicts = [_verdict(a, ref) for a, ref in zip(askers, refs)]
    return {"clients": len(askers), "takeover_s": _round(takeover_s),
            "first_token_s": _round(min(after) - killed_at if after else None),
            "answered": verdicts.count("identical") + verdicts.count("wrong"), "identical": verdicts.count("identical"),
            "wrong": verdicts.count("wrong"), "errors": [a.error for a in askers if a.error],
            "lost": verdicts.count("lost"),
            "chunks_before_kill": [sum(t <= killed_at for t in a.times) for a in askers],
            "mismatches": [_mismatch(a.tokens, ref) for a, v, ref in zip(askers, verdicts, refs) if v == "wrong"]}


def _mismatch(got: list[int], ref: list[int]) -> dict:
    at = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), min(len(got), len(ref)))
    return {"at": at, "got": len(got), "want": len(ref), "got_near": got[max(0, at - 3):at + 3],
            "want_near": ref[max(0, at - 3):at + 3]}


def _verdict(a: Asker, ref: list[int]) -> str:
    if a.done:
        return "identical" if a.tokens == ref else "wrong"
    return "error" if a.error and "failover" in a.error else "lost"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--strategy", default="flowspec")
    ap.add_argument("--repeat", type=int, default=1, help="kills, each on a fresh cluster")
    ap.add_argument("--port", type=int, default=27555)
    ap.add_argument("--json", default=None)
    ap.add_argument("--home", default=None, help="FLOWEDGE_HOME to use and keep (logs in run-N/); default: temporary")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    runs = []
    with tempfile.TemporaryDirectory(prefix="flowedge-failover-") as tmp:
        tmp = args.home or tmp
        os.environ["FLOWEDGE_HOME"] = tmp
        from flowedge.models.tiny import make_tiny_pair
        from flowedge.transport import security

        security.init_keys(Path(tmp) / "keys")
        base, draft = make_tiny_pair(Path(tmp) / "tiny")
        ps = prompts(args.clients)
        refs = references(base, ps, args.max_new)
        for i in range(args.repeat):
            run_dir = Path(tmp) / f"run-{i}"
            run_dir.mkdir(parents=True, exist_ok=True)
            nodes = Nodes(base, draft, run_dir, args.port + 4 * i, args.strategy)
            try:
                up(nodes)
                runs.append(drill(nodes, refs, ps, args.max_new, args.strategy))
                log.info("run %d: %s", i, runs[-1])
            finally:
                nodes.stop()
    out = {"command": " ".join(sys.argv), "runs": runs}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
