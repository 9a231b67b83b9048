"""Fault drills against a local flowedge cluster: kill, hang and restart nodes while requests run, and
print what the cluster did (detection time, recovery time, requests answered / errored / silent).

    python tools/fault_inject.py --model M --draft D [--nodes 3]      # starts a cluster for the drill
    python tools/fault_inject.py --attach --port 5555                 # a running `flowedge up --detach`

Drills (all by default; `--drill NAME` repeats to pick; `--strategy` for kill-restart and clients):
  kill-restart  a stage kill -9'ed mid-request, restarted under its node id `--gap` s later: the answer
                must equal an undisturbed run's (same prompt, temperature 0, ar-pp)
  never-back    a stage kill -9'ed for good: the request's error must come within the head's recovery
                deadline; then the stage is restarted and the next request must work
  sigstop       a stage SIGSTOPped: how long until the head drops it (the target is <= 3 s)
  clients       8 clients with requests queued while a stage is kill -9'ed and restarted: every request
                answered or given an error, none silent; answers vs the undisturbed one, replays, and
                whether the head started them in arrival order (from its log)
Detection times are judged from the head's own log (its 'dropped' line) against the moment of the signal.
  head-restart  the head kill -9'ed mid-request and restarted: how long until the client is told, and
                until the stages are back by themselves
Attached clusters are restarted node by node from the command lines `flowedge up` recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from flowedge.client.sync_client import Client, wait_ready
from flowedge.errors import FlowedgeError
from flowedge.launch import local_cluster

DRILLS = ("kill-restart", "never-back", "sigstop", "clients", "head-restart")
PROMPT = "Once upon a time"
LAUNCH = re.compile(r"^(\S+ \S+) INFO .*new to go \(head request (\d+)(?:, replay (\d+))?\)")
DROPPED = re.compile(r"^(\S+ \S+) ERROR .*stage (\d+) \(.*\) .*: dropped; waiting")


class Nodes:
    """The cluster's processes: node 0 is the head, k the stage in slot k."""

    def __init__(self, addr: str, run_dir: Path, pids: list[int], commands: list[list[str]],
                 cluster: local_cluster.LocalCluster | None = None) -> None:
        self.addr, self.run_dir, self.pids, self.commands, self.cluster = addr, run_dir, pids, commands, cluster

    @classmethod
    def of(cls, cluster: local_cluster.LocalCluster) -> "Nodes":
        return cls(cluster.spec.addr, cluster.run_dir, [p.pid for p in cluster.procs], cluster.commands, cluster)

    @classmethod
    def attach(cls, port: int) -> "Nodes":
        run_dir = local_cluster.flowedge_home() / "run" / f"up-{port}"
        state = json.loads((run_dir / local_cluster.STATE_FILE).read_text())
        if "commands" not in state:
            raise SystemExit("this cluster was started by an older flowedge: no command lines to restart from")
        return cls(state["addr"], run_dir, state["pids"], state["commands"])

    def signal(self, k: int, sig: int) -> None:
        os.kill(self.pids[k], sig)
        if sig == signal.SIGKILL and self.cluster is not None:
            self.cluster.procs[k].wait(10)

    def restart(self, k: int) -> None:
        if self.cluster is not None:
            self.pids[k] = self.cluster.restart(k).pid
            return
        name = local_cluster.node_names(len(self.pids))[k]
        with open(self.run_dir / f"{name}.log", "ab") as logf:
            proc = subprocess.Popen(self.commands[k], stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True, stdin=subprocess.DEVNULL)
        self.pids[k] = proc.pid
        state_file = self.run_dir / local_cluster.STATE_FILE
        state = json.loads(state_file.read_text())
        state["pids"] = self.pids
        state_file.write_text(json.dumps(state) + "\n")   # `flowedge down` stops the new process too


def stage_missing(addr: str, stage: int) -> bool:
    try:
        with Client(addr, timeout_s=2.0) as c:
            rows = c.status()
    except FlowedgeError:
        return False
    return any(r.get("stage") == stage and r.get("role") == "stage" and r.get("missing") for r in rows)


def wait_until(pred, timeout_s: float, every_s: float = 0.05) -> float | None:
    """Seconds until pred() held, None if it never did within timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


class Asker(threading.Thread):
    """One client streaming one answer in the background; `first` is set at its first token."""

    def __init__(self, addr: str, max_new: int, timeout_s: float = 120.0, strategy: str = "ar-pp") -> None:
        super().__init__(daemon=True)
        self.addr, self.max_new, self.timeout_s, self.strategy = addr, max_new, timeout_s, strategy
        self.first = threading.Event()
        self.result: dict | None = None
        self.error: str | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with Client(self.addr, timeout_s=self.timeout_s) as c:
                for _ in c.stream(PROMPT, max_new_tokens=self.max_new, strategy=self.strategy):
                    self.first.set()
                self.result = c.last_result
        except FlowedgeError as err:
            self.error = str(err)
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def reference(addr: str, max_new: int) -> list[int]:
    """The undisturbed greedy answer: plain autoregression over the same stages (no speculation)."""
    with Client(addr, timeout_s=120) as c:
        return c.generate(PROMPT, max_new_tokens=max_new, strategy="ar-pp")["token_ids"]


class HeadLog:
    """The head's own log from a point on: its timestamps judge timing (a client's polls lag on a busy box)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "head.log"
        self.start = self.path.stat().st_size if self.path.is_file() else 0

    def lines(self) -> list[str]:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode("utf-8", "replace").splitlines()

    def launches(self) -> list[tuple[int, int]]:
        """(head request key, replay number) for each run the head started, in the order it started them."""
        return [(int(m[2]), int(m[3] or 0)) for m in map(LAUNCH.match, self.lines()) if m]

    def dropped_at(self, stage: int) -> float | None:
        """Epoch seconds of the head's first 'stage k ... dropped' line, None if there is none."""
        for m in map(DROPPED.match, self.lines()):
            if m and int(m[2]) == stage:
                return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return None


def _detected(log: HeadLog, stage: int, hurt_at: float) -> float | None:
    """Seconds from the signal to the head's drop line (waits up to 15 s for the line)."""
    wait_until(lambda: log.dropped_at(stage) is not None, 15, 0.2)
    at = log.dropped_at(stage)
    return None if at is None else round(at - hurt_at, 3)


def drill_kill_restart(nodes: Nodes, max_new: int, gap_s: float, stage: int, strategy: str = "ar-pp") -> dict:
    ref = reference(nodes.addr, max_new)
    log = HeadLog(nodes.run_dir)
    ask = Asker(nodes.addr, max_new, strategy=strategy)
    ask.start()
    ask.first.wait(60)
    time.sleep(0.3)   # well into the answer: a speculative round's segments are in flight
    t0, hurt_at = time.monotonic(), time.time()
    nodes.signal(stage, signal.SIGKILL)
    detected = _detected(log, stage, hurt_at)
    time.sleep(max(0.0, gap_s - (time.monotonic() - t0)))
    nodes.restart(stage)
    ask.join(120)
    res = ask.result or {}
    return {"detected_s": detected, "answered_after_kill_s": _since(t0, ask.ended_at), "error": ask.error,
            "identical": res.get("token_ids") == ref, "tokens": len(res.get("token_ids", [])),
            "replays": res.get("replays"), "strategy": strategy, "chosen": (res.get("auto") or {}).get("choice")}


def drill_never_back(nodes: Nodes, max_new: int, recovery_s: float, stage: int) -> dict:
    ask = Asker(nodes.addr, max_new)
    ask.start()
    ask.first.wait(60)
    t0 = time.monotonic()
    nodes.signal(stage, signal.SIGKILL)
    ask.join(recovery_s + 30)
    told = _since(t0, ask.ended_at)
    nodes.restart(stage)
    wait_ready(nodes.addr, 120)
    with Client(nodes.addr, timeout_s=60) as c:
        after = len(c.generate(PROMPT, max_new_tokens=8)["token_ids"])
    return {"error_after_s": told, "error": ask.error, "answered": ask.result is not None,
            "next_request_tokens": after}


def drill_sigstop(nodes: Nodes, stage: int) -> dict:
    log = HeadLog(nodes.run_dir)
    t0, hurt_at = time.monotonic(), time.time()
    nodes.signal(stage, signal.SIGSTOP)
    try:
        detected = _detected(log, stage, hurt_at)
    finally:
        nodes.signal(stage, signal.SIGCONT)
    back = wait_until(lambda: _ready(nodes.addr), 60, 0.2)
    return {"detected_s": detected, "back_after_s": None if back is None else round(time.monotonic() - t0, 2)}


def drill_clients(nodes: Nodes, max_new: int, gap_s: float, stage: int, n: int = 8,
                  strategy: str = "ar-pp") -> dict:
    """More clients than the head runs at once, so some wait in its queue while the stage is lost."""
    ref = reference(nodes.addr, max_new)
    log = HeadLog(nodes.run_dir)
    askers = [Asker(nodes.addr, max_new, timeout_s=90, strategy=strategy) for _ in range(n)]
    for a in askers:
        a.start()
        time.sleep(0.1)   # arrival order = start order
    askers[0].first.wait(60)
    nodes.signal(stage, signal.SIGKILL)
    time.sleep(gap_s)
    nodes.restart(stage)
    for a in askers:
        a.join(120)
    firsts = [key for key, replay in log.launches() if replay == 0]
    return {"clients": n, "answered": sum(a.result is not None for a in askers),
            "identical": sum((a.result or {}).get("token_ids") == ref for a in askers),
            "replays": sum((a.result or {}).get("replays") or 0 for a in askers),
            "first_starts": firsts, "fifo": firsts == sorted(firsts),
            "errored": sum(a.error is not None for a in askers),
            "silent": sum(a.result is None and a.error is None for a in askers),
            "errors": sorted({a.error for a in askers if a.error})}


def drill_head_restart(nodes: Nodes, max_new: int) -> dict:
    ask = Asker(nodes.addr, max_new)
    ask.start()
    ask.first.wait(60)
    t0 = time.monotonic()
    nodes.signal(0, signal.SIGKILL)
    ask.join(30)
    told = _since(t0, ask.ended_at)
    nodes.restart(0)
    wait_ready(nodes.addr, 180)
    back = round(time.monotonic() - t0, 2)
    with Client(nodes.addr, timeout_s=60) as c:
        after = len(c.generate(PROMPT, max_new_tokens=8)["token_ids"])
    return {"client_told_s": told, "error": ask.error, "stages_back_s": back, "next_request_tokens": after}


def _ready(addr: str) -> bool:
    try:
        with Client(addr, timeout_s=2.0) as c:
            return bool(c.status()[0].get("ready"))
    except FlowedgeError:
        return False


def _since(t0: float, t: float | None) -> float | None:
    return None if t is None else round(t - t0, 2)


def run_drills(nodes: Nodes, drills, *, max_new: int, gap_s: float, recovery_s: float, stage: int,
               strategy: str = "ar-pp") -> dict:
    out: dict = {}
    for name in drills:
        wait_ready(nodes.addr, 180)
        if name == "kill-restart":
            out[name] = drill_kill_restart(nodes, max_new, gap_s, stage, strategy)
        elif name == "never-back":
            out[name] = drill_never_back(nodes, max_new, recovery_s, stage)
        elif name == "sigstop":
            out[name] = drill_sigstop(nodes, stage)
        elif name == "clients":
            out[name] = drill_clients(nodes, max_new, gap_s, stage, strategy=strategy)
        elif name == "head-restart":
            out[name] = drill_head_restart(nodes, max_new)
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attach", action="store_true", help="drill a running `flowedge up --detach` cluster")
    ap.add_argument("--port", type=int, default=5585)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--drill", action="append", choices=DRILLS, help="default: every drill")
    ap.add_argument("--stage", type=int, default=0, help="stage to hurt (default: the last)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--strategy", default="ar-pp", help="kill-restart and clients: the requests' strategy")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds before a killed stage is restarted")
    ap.add_argument("--recovery", type=float, default=8.0, help="the head's recovery deadline (new clusters)")
    args = ap.parse_args()
    cluster = None
    if args.attach:
        nodes = Nodes.attach(args.port)
    else:
        spec = local_cluster.LocalClusterSpec(nodes=args.nodes, model=args.model, draft=args.draft, port=args.port,
                                              threads=1, wire_dtype="float32", recovery_s=args.recovery)
        cluster = local_cluster.start(spec)
        nodes = Nodes.of(cluster)
    stage = args.stage or len(nodes.pids) - 1
    try:
        figures = run_drills(nodes, args.drill or DRILLS, max_new=args.max_new_tokens, gap_s=args.gap,
                             recovery_s=args.recovery, stage=stage, strategy=args.strategy)
    finally:
        if cluster is not None:
            cluster.stop()
    print(json.dumps(figures, indent=2))
    sys.exit(0)


if __name__ == "__main__":
    main()
