"""A cluster of real processes for the board-lost tests: a head and its stages started one by one with
`flowedge serve` / `flowedge join`, each stage with its own FLOWEDGE_HOME (so it fetches every shard from
the head over the wire, checksummed, as a board of its own would) and its own settings file; optionally a
standby head (its own home too) that the stages and clients also know."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster_helpers import READY_TIMEOUT_S, free_port_pair, logs
from flowedge.client.sync_client import Client, wait_ready

HEARTBEAT_MS = 200   # the head's heartbeat period: a standby's liveness signal too
FAILOVER_S = 1.5     # a standby takes over after this long without a word from the head


@dataclass
class BoardCluster:
    run_dir: Path
    base: Path
    draft: Path
    stages: int = 3
    recovery_s: float = 10.0
    offers_gib: list[float] = field(default_factory=list)   # per stage; empty: the OS's free memory
    context: int = 4096                                      # KV tokens the planner reserves per stage
    port: int = field(default_factory=free_port_pair)
    standby: bool = False      # a standby head at port + 2, taking over after FAILOVER_S of silence
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def heads(self) -> str:
        """Every head address, the head's first: what stages and clients are given."""
        return f"{self.addr},127.0.0.1:{self.port + 2}" if self.standby else self.addr

    def start(self) -> "BoardCluster":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        head = self.run_dir / "head.toml"
        head.write_text("\n".join([
            'role = "head"', f'head = "{self.addr}"', 'node_id = "head"', "threads = 1", "insecure = true",
            "discovery = false", f'model = "{self.base}"', f'draft = "{self.draft}"', f"stages = {self.stages}",
            'wire_dtype = "float32"', f"recovery_s = {self.recovery_s}", "max_concurrent = 4",
            f"context = {self.context}",
            *([f"heartbeat_ms = {HEARTBEAT_MS}"] if self.standby else [])]) + "\n")
        self._spawn("head", ["serve", "--config", str(head)])
        if self.standby:
            standby = self.run_dir / "standby.toml"
            standby.write_text(head.read_text().replace('role = "head"', 'role = "standby"').replace(
                'node_id = "head"', 'node_id = "standby"') + f'listen = "127.0.0.1:{self.port + 2}"\n'
                f"failover_s = {FAILOVER_S}\n")
            self._spawn("standby", ["join", self.addr, "--config", str(standby), "--standby"],
                        self.run_dir / "home-standby")
        for k in range(1, self.stages + 1):
            self.join(k)
        try:
            wait_ready(self.addr, READY_TIMEOUT_S, insecure=True, alive=self.alive)
        except BaseException:
            self.stop()
            raise AssertionError("cluster did not start:\n" + logs(self.run_dir)) from None
        return self

    def join(self, k: int) -> None:
        """Stage k's process (again, after a kill: the same node id, home and settings)."""
        cfg = self.run_dir / f"stage-{k}.toml"
        offer = self.offers_gib[k - 1] if self.offers_gib else 0.0
        cfg.write_text(f"memory_offer_gib = {offer!r}\n")
        home = self.run_dir / f"home-{k}"
        self._spawn(f"stage-{k}", ["join", "--heads", self.heads, "--config", str(cfg), "--node-id", f"stage-{k}",
                                   "--stage", str(k), "--threads", "1", "--insecure"], home)

    def _spawn(self, name: str, args: list[str], home: Path | None = None) -> None:
        env = {**os.environ, "FLOWEDGE_HOME": str(home or self.run_dir / "home-head"), "OMP_NUM_THREADS": "1"}
        with open(self.run_dir / f"{name}.log", "ab") as logf:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "flowedge", "-v", *args], stdout=logf,
                                                stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.procs["head"].poll() is None

    def kill(self, name: str) -> float:
        """kill -9; returns when (monotonic)."""
        self.procs[name].send_signal(signal.SIGKILL)
        at = time.monotonic()
        self.procs[name].wait(10)
        return at

    def client(self, timeout_s: float = 120.0) -> Client:
        return Client(self.heads, insecure=True, timeout_s=timeout_s)

    def head_row(self) -> dict:
        with self.client(10.0) as c:
            return c.status()[0]

    def stage_rows(self) -> list[dict]:
        with self.client(10.0) as c:
            return [r for r in c.status() if r.get("role") == "stage"]

    def log(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
