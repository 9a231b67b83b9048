"""A soak: a local cluster and its HTTP front under mixed load and chaos for a given time, then what was
lost, what was wrong and how every process's memory, descriptors and threads moved.

    python tools/soak.py --duration 300                       # tiny pair (made in a temporary home)
    python tools/soak.py --duration 3600 --real --json soak.json

Load (tools/soak_load.py): ZeroMQ and HTTP clients, whole and streaming answers, cancels and clients that
vanish mid-stream, at most --concurrency at once and --rate a second, every T=0 answer compared with the
undisturbed one. Faults (tools/soak_faults.py, a pluggable schedule): a random stage kill -9'ed every
--stage-kill-every s (10 min) and restarted --gap s later (or never, --no-restart); optionally a quick
--chaos-every (kill and restart, or SIGSTOP for --stop-for s), one board lost for good at --board-lost-at s
(the head re-plans onto the survivors, `replan_on_loss`) and a head kill -9 every --head-kill-every s
(needs --standby: a standby head the stages, clients and HTTP front also know; the killed head comes back
as the new standby unless --no-head-restart, tools/soak_standby.py). Outcomes: sent, answered correctly
(T=0 == the undisturbed answer), clear errors, lost (no answer, or a cut connection), spurious errors (a
clear error while nothing was hurt and the head said ready). Every --sample-every s each process's RSS,
open descriptors and threads are sampled; the slopes per hour (least squares, after --warmup s) are
printed with the counts and written to --json. Everything listens on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from soak_faults import Schedule, schedule
from soak_load import Load, Readiness, Tally
from soak_standby import Standby
from flowedge.client.sync_client import wait_ready
from flowedge.errors import ConfigError
from flowedge.launch import local_cluster
from flowedge.transport.addresses import free_port_run

log = logging.getLogger("soak")


class Processes:
    """The cluster's processes and the HTTP front, by name; a restarted stage keeps its name."""

    def __init__(self, cluster: local_cluster.LocalCluster, http: subprocess.Popen) -> None:
        self.cluster, self.http = cluster, http
        self.lock = threading.Lock()
        self.lost: set[int] = set()    # stage slots killed for good
        self.standby: Standby | None = None   # a standby head, where the soak runs one (--standby)

    def kill_for_good(self, k: int) -> None:
        os.kill(self.cluster.procs[k].pid, signal.SIGKILL)
        self.cluster.procs[k].wait(10)
        self.lost.add(k)

    @property
    def heads(self) -> str:
        """The head addresses clients and the HTTP front are given."""
        return ",".join(self.standby.heads) if self.standby else self.cluster.spec.addr

    def can_kill_head(self) -> bool:
        return self.standby is not None and self.standby.proc is not None

    def kill_head(self) -> str:
        if not self.can_kill_head():
            raise ConfigError("no standby head: killing the head would end the soak")
        return self.standby.kill_head()   # no lock: it waits for the takeover, and the sampler reads pids()

    def pids(self) -> dict[str, int]:
        with self.lock:
            names = local_cluster.node_names(len(self.cluster.procs))
            standby = {"standby": self.standby.proc.pid} if self.standby and self.standby.proc else {}
            return {**{n: p.pid for n, p in zip(names, self.cluster.procs)}, **standby, "http": self.http.pid}

    def kill_restart(self, k: int, gap_s: float) -> None:
        pid = self.cluster.procs[k].pid
        os.kill(pid, signal.SIGKILL)
        self.cluster.procs[k].wait(10)
        time.sleep(gap_s)
        with self.lock:
            self.cluster.restart(k)

    def stop_cont(self, k: int, stop_for_s: float) -> None:
        pid = self.cluster.procs[k].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stop_for_s)
        finally:
            os.kill(pid, signal.SIGCONT)


def sample(procs: Processes, every_s: float, stop: threading.Event, rows: list, memdebug_every: int = 0) -> None:
    """(t, name, pid, rss MB, fds, threads) for every live process, every `every_s` seconds; every
    `memdebug_every`-th time the head is also asked for its memdebug report (SIGUSR2)."""
    t0, n = time.monotonic(), 0
    while True:
        if memdebug_every and n % memdebug_every == 0:
            os.kill(procs.pids()["head"], signal.SIGUSR2)
        n += 1
        for name, pid in procs.pids().items():
            try:
                p = psutil.Process(pid)
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    continue   # a SIGSTOPped stage's figures are frozen; a killed one's are gone
                rows.append((time.monotonic() - t0, name, pid, p.memory_info().rss / 2**20, p.num_fds(),
                             p.num_threads()))
            except psutil.Error:
                pass   # killed between the listing and the sample
        if stop.wait(every_s):
            return


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value), per hour."""
    n = len(points)
    if n < 3:
        return None
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return None if den == 0 else 3600 * sum((t - mt) * (v - mv) for t, v in points) / den


def slopes(rows: list, warmup_s: float) -> dict:
    """Per process (its longest-lived pid: a restarted stage starts over, and chaos restarts stages
    often), after the warm-up: first and last sample and the slope per hour of RSS (MB and % of the
    mean), fds and threads."""
    out = {}
    for name in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == name]
        lives = {p: [r for r in mine if r[2] == p] for p in dict.fromkeys(r[2] for r in mine)}
        pid = max(lives, key=lambda p: lives[p][-1][0] - lives[p][0][0])
        live = lives[pid]
        after = [r for r in live if r[0] - live[0][0] >= warmup_s] if name.startswith("stage") else \
            [r for r in live if r[0] >= warmup_s]
        if len(after) < 3:
            out[name] = {"pid": pid, "samples": len(after), "note": "too few samples after the warm-up"}
            continue
        rss = slope_per_hour([(r[0], r[3]) for r in after])
        mean = sum(r[3] for r in after) / len(after)
        fds, fds_mean = slope_per_hour([(r[0], r[4]) for r in after]), max(1.0, sum(r[4] for r in after) / len(after))
        out[name] = {"pid": pid, "samples": len(after), "span_s": round(after[-1][0] - after[0][0], 1),
                     "rss_mb": [round(after[0][3], 1), round(after[-1][3], 1)],
                     "rss_mb_per_h": round(rss, 2), "rss_pct_per_h": round(100 * rss / mean, 2),
                     "fds": [after[0][4], after[-1][4]],
                     "fds_per_h": round(fds, 2), "fds_pct_per_h": round(100 * fds / fds_mean, 2),
                     "threads": [after[0][5], after[-1][5]],
                     "threads_per_h": round(slope_per_hour([(r[0], r[5]) for r in after]), 2)}
    return out


@dataclass
class ClusterOptions:
    """What `start` needs to bring a cluster and its HTTP front up; other tools fill only what they change."""

    real: bool = False            # the real pair (model, draft) rather than a tiny generated one
    model: str = ""
    draft: str = ""
    nodes: int = 3
    port: int = 0                 # 0: a free one
    http_port: int = 0
    recovery: float = 30.0        # seconds the head waits for a lost stage to come back
    standby: bool = False         # run a standby head too
    no_head_restart: bool = False
    http_args: list[str] = field(default_factory=list)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ClusterOptions":
        return cls(real=args.real, model=args.model, draft=args.draft, nodes=args.nodes, port=args.port,
                   http_port=args.http_port, recovery=args.recovery, standby=args.standby,
                   no_head_restart=args.no_head_restart)


def start(args: ClusterOptions, home: Path) -> Processes:
    if args.real:
        model, draft = args.model, args.draft
    else:
        from flowedge.models.tiny import make_tiny_pair

        model, draft = map(str, make_tiny_pair(home / "tiny-pair"))
    port = args.port or free_port_run(3)
    standby_addr = f"127.0.0.1:{port + 2}" if args.standby else ""
    spec = local_cluster.LocalClusterSpec(nodes=args.nodes, model=model, draft=draft, port=port,
                                          threads=1, recovery_s=args.recovery, standby_addr=standby_addr)
    cluster = local_cluster.start(spec)
    standby = Standby(cluster, standby_addr, restart=not args.no_head_restart) if args.standby else None
    try:
        wait_ready(spec.addr, 600, alive=cluster.alive)
        if standby:
            standby.start()
            standby.wait_following(600)
        heads = ",".join(standby.heads) if standby else spec.addr
        listen = f"127.0.0.1:{args.http_port or free_port_run(1)}"
        with open(cluster.run_dir / "http.log", "ab") as logf:
            http = subprocess.Popen([sys.executable, "-m", "flowedge", "http", "--listen", listen,
                                     "--head", heads, *args.http_args],
                                    stdout=logf, stderr=subprocess.STDOUT)
        procs = Processes(cluster, http)
        procs.standby = standby
        procs.base = f"http://{listen}"
        for _ in range(600):
            try:
                if httpx.get(procs.base + "/health", timeout=2).status_code == 200:
                    return procs
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the HTTP front did not come up; see " + str(cluster.run_dir / "http.log"))
    except BaseException:
        if standby:
            standby.stop()
        cluster.stop(grace_s=2.0)
        raise


def soak(args, procs: Processes, faults: Schedule) -> dict:
    addr = procs.heads   # every head address: clients follow a standby that takes over
    tally, readiness = Tally(), Readiness(addr)
    load = Load(addr, procs.base, tally, readiness, concurrency=args.concurrency, rate=args.rate, seed=args.seed)
    load.references()
    stop, rows = threading.Event(), []
    every = max(1, round(args.memdebug_every / args.sample_every)) if args.memdebug else 0
    threads = [threading.Thread(target=sample, args=(procs, args.sample_every, stop, rows, every), daemon=True),
               threading.Thread(target=readiness.poll, args=(stop,), daemon=True),
               threading.Thread(target=faults.run, args=(procs, readiness, stop), daemon=True)]
    for t in threads:
        t.start()
    workers = load.run(stop)
    t0 = time.monotonic()
    while not stop.wait(min(30.0, max(0.0, args.duration - (time.monotonic() - t0)))):
        if time.monotonic() - t0 >= args.duration:
            break
        log.info("%.0f s: %s", time.monotonic() - t0, tally.line())
    stop.set()
    for t in workers + threads:
        t.join(200)
    return {"duration_s": args.duration, "nodes": args.nodes, "real": args.real, "chaos": faults.counts,
            "faults": faults.done, **tally.as_dict(), "processes": slopes(rows, args.warmup), "samples": len(rows),
            "series": [[round(r[0], 1), r[1], r[2], round(r[3], 2)] for r in rows],   # t, name, pid, rss MB
            "run_dir": str(procs.cluster.run_dir), "memdebug": memdebug_summary(args.memdebug)}


def memdebug_summary(path: str | None) -> dict | None:
    """The head's first and last memdebug reports: RSS vs what Python allocations explain, top growers."""
    if not path or not Path(path).is_file():
        return None
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    first, last = lines[0], lines[-1]
    return {"reports": len(lines), "span_s": round(last["t"] - first["t"], 1),
            "rss_mb": [first["rss_mb"], last["rss_mb"]], "traced_mb": [first["traced_mb"], last["traced_mb"]],
            "heap": [first.get("heap"), last.get("heap")],
            "heap_series": [(round(x["t"] - first["t"], 1), x["rss_mb"], x.get("heap")) for x in lines],
            "grew": last["grew"][:10],
            "objects_grew": {k: v - first["objects"].get(k, 0) for k, v in last["objects"].items()
                             if v - first["objects"].get(k, 0) > 100}}


def report(fig: dict) -> None:
    print(f"requests {fig['requests']} {fig['by_kind']}  faults {fig['chaos']}")
    print(f"sent {fig['sent']}  answered correctly {fig['answered_ok']}  wrong at T=0 {fig['wrong_at_t0']}  "
          f"clear errors {fig['clear_errors']}  lost {fig['lost']}  spurious errors {fig['spurious_errors']}  "
          f"(spurious 503s {fig['spurious_503']})")
    print(f"failures {sum(fig['failures'].values())}: {json.dumps(fig['failures'])}")
    if fig.get("memdebug"):
        md = fig["memdebug"]
        print(f"head memdebug over {md['span_s']} s: rss {md['rss_mb']} MB, Python-traced {md['traced_mb']} MB; "
              f"objects grew {md['objects_grew']}")
        print(f"    glibc heap first {md['heap'][0]}\n    glibc heap last  {md['heap'][1]}")
        for g in md["grew"][:5]:
            print(f"    {g['kb']:+10.1f} KB {g['count']:+7d}  {g['site']}")
    for name, p in fig["processes"].items():
        if "rss_mb_per_h" not in p:
            print(f"  {name:8s} {p['note']}")
            continue
        print(f"  {name:8s} rss {p['rss_mb'][0]:.1f}->{p['rss_mb'][1]:.1f} MB ({p['rss_mb_per_h']:+.2f} MB/h, "
              f"{p['rss_pct_per_h']:+.2f}%/h)  fds {p['fds'][0]}->{p['fds'][1]} ({p['fds_per_h']:+.1f}/h, "
              f"{p['fds_pct_per_h']:+.1f}%/h)  threads {p['threads'][0]}->{p['threads'][1]} "
              f"({p['threads_per_h']:+.1f}/h)  over {p['span_s']} s")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--real", action="store_true", help="the real pair (--model/--draft) instead of the tiny one")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--port", type=int, default=0, help="the head's port (0: a free one)")
    ap.add_argument("--http-port", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rate", type=float, default=4.0, help="requests a second at most, all workers together")
    ap.add_argument("--stage-kill-every", type=float, default=600.0,
                    help="kill -9 a random stage every this many s (0: never)")
    ap.add_argument("--no-restart", action="store_true", help="those killed stages stay dead")
    ap.add_argument("--chaos-every", type=float, default=0.0,
                    help="also, every this many s, kill and restart or SIGSTOP a random stage (0: never)")
    ap.add_argument("--board-lost-at", type=float, default=0.0,
                    help="once, this many s in, kill a stage for good (0: never); the cluster must re-plan")
    ap.add_argument("--head-kill-every", type=float, default=0.0,
                    help="kill -9 the head every this many s (0: never); refused without --standby")
    ap.add_argument("--standby", action="store_true",
                    help="run a standby head too; stages, clients and the HTTP front are given both addresses")
    ap.add_argument("--no-head-restart", action="store_true",
                    help="a killed head stays dead (by default it comes back as the new standby): one head kill")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds before a killed stage is restarted")
    ap.add_argument("--stop-for", type=float, default=3.0, help="seconds a stage stays SIGSTOPped")
    ap.add_argument("--recovery", type=float, default=30.0, help="the head's recovery deadline")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the slopes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--home", default=None, help="tiny pair: FLOWEDGE_HOME for the run (default: a new temp dir)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--memdebug", default=None, metavar="FILE",
                    help="run the head with FLOWEDGE_MEMDEBUG=FILE (tracemalloc) and ask it for a report every "
                         "--memdebug-every s (node/memdebug.py); for finding memory only: tracing slows the "
                         "head enough on 2 cores that clients time out on HELLO (~17%% failed in 5 min)")
    ap.add_argument("--memdebug-every", type=float, default=60.0)
    ap.add_argument("--memdebug-heap-only", action="store_true",
                    help="with --memdebug: glibc's heap figures only, no tracemalloc (cheap enough for an hour)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    faults = Schedule(schedule(args), seed=args.seed)
    try:
        faults.check(standby=args.standby)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line a request
    home = Path(args.home or tempfile.mkdtemp(prefix="flowedge-soak-"))   # kept: the nodes' logs are there
    if not args.real:
        os.environ["FLOWEDGE_HOME"] = str(home)   # keys and run dirs of a throwaway tiny cluster
    if args.memdebug:
        os.environ["FLOWEDGE_MEMDEBUG"] = str(Path(args.memdebug).resolve())   # the head installs it
        if args.memdebug_heap_only:
            os.environ["FLOWEDGE_MEMDEBUG_PYTHON"] = "0"
    procs = start(ClusterOptions.from_args(args), home)
    try:
        fig = soak(args, procs, faults)
    finally:
        procs.http.send_signal(signal.SIGTERM)
        procs.http.wait(20)
        if procs.standby:
            procs.standby.stop()
        procs.cluster.stop()
    report(fig)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")


if __name__ == "__main__":
    main()
