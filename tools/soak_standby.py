"""The standby half of tools/soak.py: a standby head beside the local cluster's head, and the head kill.

The standby is started with the head's own settings (the head.toml `flowedge up` wrote, so the plans
match) plus `role = "standby"`, the head it follows and the address it serves at once it takes over.
A head kill is a kill -9 of whichever process is the head now; the standby takes over, and (unless told
not to) the killed head's address is started again as the new standby following it, as
docs/operations.md says a deposed head should come back. The two addresses swap roles at each kill.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flowedge.client.sync_client import Client
from flowedge.errors import FlowedgeError

log = logging.getLogger("soak")

FOLLOWING = "standby: following head"
FAILOVER_S = 1.5   # the standby takes over after this much silence from the head


def standby_config(head_toml: Path, out: Path, head: str, listen: str, node_id: str) -> Path:
    """The head's config with the standby's keys: same model, stages and layers, so the plans are one."""
    keep = [line for line in head_toml.read_text().splitlines()
            if line.split("=")[0].strip() not in ("role", "head", "node_id", "listen", "failover_s")]
    out.write_text("\n".join(keep + ['role = "standby"', f'head = "{head}"', f'listen = "{listen}"',
                                     f'node_id = "{node_id}"', f"failover_s = {FAILOVER_S}"]) + "\n")
    return out


def log_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


class Standby:
    """The standby head process and the two head addresses; `heads[0]` is the head's, `heads[1]` the
    standby's."""

    def __init__(self, cluster, listen: str, restart: bool = True) -> None:
        self.cluster, self.restart = cluster, restart
        self.heads = [cluster.spec.addr, listen]
        self.proc: subprocess.Popen | None = None
        self.log_from = 0          # where the standby's log started, for its "following" line
        self.kills = 0

    @property
    def log_path(self) -> Path:
        return self.cluster.run_dir / "standby.log"

    def start(self) -> subprocess.Popen:
        """A standby at heads[1] following the head at heads[0]."""
        head, listen = self.heads
        node_id = f"standby-{self.kills}"
        cfg = standby_config(self.cluster.run_dir / "head.toml", self.cluster.run_dir / f"{node_id}.toml", head,
                             listen, node_id)
        self.log_from = log_size(self.log_path)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "flowedge", "-v", "join", head, "--config", str(cfg),
                                          "--standby"], stdout=logf, stderr=subprocess.STDOUT,
                                         env=self.cluster.env, stdin=subprocess.DEVNULL)
        return self.proc

    def following(self) -> bool:
        with open(self.log_path, "rb") as f:
            f.seek(self.log_from)
            return FOLLOWING.encode() in f.read()

    def wait_following(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.following():
            if self.proc is None or self.proc.poll() is not None:
                raise FlowedgeError(f"the standby head exited; see {self.log_path}")
            if time.monotonic() > deadline:
                raise FlowedgeError(f"the standby never followed the head in {timeout_s:g} s; see {self.log_path}")
            time.sleep(0.2)

    def kill_head(self, timeout_s: float = 120.0) -> str:
        """kill -9 the head; the standby becomes slot 0; the killed address comes back as the new standby
        once the new head serves (or stays down: then no further head kill is possible)."""
        self.wait_following(timeout_s)   # a standby still loading could not take over
        old = self.cluster.procs[0]
        os.kill(old.pid, signal.SIGKILL)
        old.wait(10)
        self.cluster.procs[0], self.proc = self.proc, None
        self.heads.reverse()
        self.kills += 1
        took = wait_serving(self.heads[0], timeout_s)
        what = f"head at {self.heads[1]} killed; standby at {self.heads[0]} serving after {took:.1f} s" \
            if took is not None else f"head at {self.heads[1]} killed; the standby did not serve in {timeout_s:g} s"
        log.info("soak: %s", what)
        if self.restart:
            self.start()
            what += f"; restarted at {self.heads[1]} as the new standby"
        return what

    def stop(self) -> None:
        """Stop the standby, and ask a head that took over to stop its stages (the cluster's own stop asks
        the first head's address only)."""
        if self.heads[0] != self.cluster.spec.addr and self.cluster.procs[0].poll() is None:
            try:
                with Client(self.heads[0], timeout_s=3.0) as c:
                    c.shutdown("the soak is over")
            except FlowedgeError as err:
                log.warning("the head at %s did not take the shutdown request: %s", self.heads[0], err)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def wait_serving(addr: str, timeout_s: float) -> float | None:
    """Seconds until the head at `addr` says it is ready (its stages rejoined), or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            with Client(addr, timeout_s=1.0) as c:
                if c.status()[0].get("ready"):
                    return time.monotonic() - t0
        except FlowedgeError:
            pass
        time.sleep(0.1)
    return None
