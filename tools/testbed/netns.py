"""The testbed's network: a router namespace holding a bridge, one namespace per device joined to it by a
veth pair, and nothing at all in the host's own namespace (every link is created inside a testbed namespace,
so deleting the namespaces deletes everything).

Addressing, the same in every testbed (they never share a namespace):
- device i's real address is 10.98.0.(i+1) on its `eth0`; the router's is 10.98.0.254 on `br0`;
- device i's virtual address is 10.99.0.(i+1), held on the router's loopback, where the relay listens.
  Devices route 10.99.0.0/24 via the router, so all traffic between devices crosses the relay.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass

log = logging.getLogger("testbed.netns")

PREFIX = "fetb-"
REAL_NET = "10.98.0"
VIRTUAL_NET = "10.99.0"
ROUTER_IP = f"{REAL_NET}.254"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def real_ip(i: int) -> str:
    return f"{REAL_NET}.{i + 1}"


def virtual_ip(i: int) -> str:
    return f"{VIRTUAL_NET}.{i + 1}"


@dataclass(frozen=True)
class Network:
    """The namespaces of one testbed `tag` with `devices` devices."""
    tag: str
    devices: int

    @property
    def router(self) -> str:
        return f"{PREFIX}{self.tag}-r"

    def device(self, i: int) -> str:
        return f"{PREFIX}{self.tag}-d{i}"

    def namespaces(self) -> list[str]:
        return [self.router] + [self.device(i) for i in range(self.devices)]

    def create(self) -> None:
        """Build the namespaces, the bridge and the veths; on any error the caller's teardown removes them."""
        r = self.router
        ip("netns", "add", r)
        ip("-n", r, "link", "set", "lo", "up")
        ip("-n", r, "link", "add", "br0", "type", "bridge")
        ip("-n", r, "addr", "add", f"{ROUTER_IP}/24", "dev", "br0")
        ip("-n", r, "link", "set", "br0", "up")
        for i in range(self.devices):
            d = self.device(i)
            ip("netns", "add", d)
            ip("-n", d, "link", "set", "lo", "up")
            ip("-n", r, "link", "add", f"d{i}", "type", "veth", "peer", "name", "eth0", "netns", d)
            ip("-n", r, "link", "set", f"d{i}", "master", "br0")
            ip("-n", r, "link", "set", f"d{i}", "up")
            ip("-n", r, "addr", "add", f"{virtual_ip(i)}/32", "dev", "lo")
            ip("-n", d, "addr", "add", f"{real_ip(i)}/24", "dev", "eth0")
            ip("-n", d, "link", "set", "eth0", "up")
            ip("-n", d, "route", "add", f"{VIRTUAL_NET}.0/24", "via", ROUTER_IP)

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def destroy(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them (their links go with them)."""
        for ns in self.namespaces():
            kill_namespace(ns)


def existing() -> list[str]:
    """Every testbed namespace on this host (ours by the prefix)."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def tag_of(ns: str) -> str:
    return ns.removeprefix(PREFIX).rsplit("-", 1)[0]


def kill_namespace(ns: str, timeout_s: float = 5.0) -> None:
    """SIGKILL the processes in `ns` until none is left, then delete it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    res = ip("netns", "del", ns, check=False)
    if res.returncode != 0 and ns in existing():
        log.warning("cannot delete namespace %s: %s", ns, res.stderr.strip())


def can_create() -> str | None:
    """None when this process may create namespaces; else why not (for skips and the CLI's refusal)."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, veth pairs, cgroups)"
    probe = f"{PREFIX}probe{os.getpid()}"
    res = ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` fails here: {res.stderr.strip() or res.returncode}"
    ip("netns", "del", probe, check=False)
    return None
