"""One testbed: N devices on this Linux box, each a network namespace with a cgroup limiting its CPU and
memory, every byte between them crossing the relay that impairs the link (netns.py, relay.py, cgroups.py).

`Testbed` is a context manager: entering builds everything, leaving (normally, by an exception, by
SIGTERM/SIGHUP/SIGINT, or at interpreter exit) tears it all down: processes, namespaces with their veths,
cgroups and the state file. A testbed killed with SIGKILL leaves a state file naming its owner pid;
`cleanup` (run also before every new testbed) removes whatever a dead owner left.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.testbed import cgroups, netns
from tools.testbed.relay import LINK_ACK, LINK_FILE, LinkShape, RelaySpec, Route, as_dict

log = logging.getLogger("testbed")

REPO = Path(__file__).resolve().parents[2]
STATE_DIR = Path("/run/flowedge-testbed")
READY_TIMEOUT_S = 10.0
# ports every device's services may listen on, each relayed at its virtual address: flowedge's head
# (control, pipeline return), a stage's data port, llama.cpp's RPC server and llama-server
SERVICE_PORTS = (5555, 5556, 5600, 50052, 8080)
MARKER = "FLOWEDGE_TESTBED"


@dataclass(frozen=True)
class TestbedSpec:
    devices: int
    link: LinkShape
    cpus: float = 1.0            # per device
    memory_mb: int = 4096        # per device
    tag: str = field(default_factory=lambda: f"{os.getpid():x}")
    ports: tuple[int, ...] = SERVICE_PORTS
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.devices <= 200:
            raise SystemExit(f"devices must be 1..200, got {self.devices}")
        if "-" in self.tag or not self.tag:
            raise SystemExit(f"a testbed tag is a short word without '-', got {self.tag!r}")

    @property
    def threads(self) -> int:
        """Threads for a device's compute process: its CPU quota rounded up."""
        return max(1, math.ceil(self.cpus))


class Testbed:
    def __init__(self, spec: TestbedSpec, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.extra_env = dict(env or {})
        self.net = netns.Network(spec.tag, spec.devices)
        self.log_dir = log_dir
        self.groups: list[cgroups.Cgroup] = []
        self.procs: list[subprocess.Popen] = []
        self.relay: subprocess.Popen | None = None
        self._down = True

    # --- addresses ---------------------------------------------------------------------------------------
    def addr(self, i: int) -> str:
        """Where other devices reach device i (through the relay)."""
        return netns.virtual_ip(i)

    def local_addr(self, i: int) -> str:
        """Device i's own address, where its services listen."""
        return netns.real_ip(i)

    # --- life cycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        why = netns.can_create()
        if why:
            raise SystemExit(f"testbed: {why}")
        cleanup(everything=False)
        self._down = False
        atexit.register(self.down)
        self._old_handlers = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()
        for sig, old in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, old)

    def _up(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps({"owner": os.getpid(), "devices": self.spec.devices}) + "\n")
        self.net.create()
        limits = cgroups.Limits(self.spec.cpus, self.spec.memory_mb)
        self.groups = [cgroups.create(self.spec.tag, f"d{i}", limits) for i in range(self.spec.devices)]
        self._start_relay()
        log.info("testbed %s up: %d devices, link %s, %.2g cpus and %d MB each", self.spec.tag,
                 self.spec.devices, self.spec.link, self.spec.cpus, self.spec.memory_mb)

    def _start_relay(self) -> None:
        n = self.spec.devices
        routes = tuple(Route(netns.virtual_ip(i), p, netns.real_ip(i), p, f"d{i}")
                       for i in range(n) for p in self.spec.ports)
        spec = RelaySpec(routes=routes, links={}, peers={netns.real_ip(i): f"d{i}" for i in range(n)},
                         default=self.spec.link, seed=self.spec.seed)
        spec_file, ready = self.log_dir / "relay.json", self.log_dir / "relay.ready"
        spec_file.write_text(json.dumps(spec.to_dict()))
        ready.unlink(missing_ok=True)
        logf = open(self.log_dir / "relay.log", "ab")
        self.relay = subprocess.Popen(self.net.exec_prefix(self.net.router) +
                                      [sys.executable, "-m", "tools.testbed.relay", str(spec_file), str(ready)],
                                      stdout=logf, stderr=subprocess.STDOUT, env=self.env(), cwd=REPO,
                                      start_new_session=True)
        logf.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if self.relay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the relay did not start: " + (self.log_dir / "relay.log").read_text()[-2000:])
            time.sleep(0.05)

    def set_link(self, shape: LinkShape) -> None:
        """Reshape every link now (e.g. unimpaired while models load, then the preset for the measurement)."""
        ack = self.log_dir / LINK_ACK
        ack.unlink(missing_ok=True)
        (self.log_dir / LINK_FILE).write_text(json.dumps(as_dict(shape)))
        self.relay.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ack.exists():
            if self.relay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the relay did not take the new link shape")
            time.sleep(0.02)

    def down(self) -> None:
        """Tear everything down; safe to call more than once."""
        if self._down:
            return
        self._down = True
        for p in self.procs:
            terminate(p)
        for group in self.groups:
            group.kill()
        if self.relay is not None:
            terminate(self.relay)
        self.net.destroy()
        cgroups.remove_tag(self.spec.tag)
        kill_marked(self.spec.tag)
        self._state_file().unlink(missing_ok=True)
        log.info("testbed %s down", self.spec.tag)

    def _state_file(self) -> Path:
        return STATE_DIR / f"{self.spec.tag}.json"

    # --- processes ----------------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of the testbed's processes: ours, the testbed's extra variables, the repository on
        PYTHONPATH, and MARKER=tag (how a test tells the testbed's processes from any other)."""
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, **self.extra_env, "PYTHONPATH": path, MARKER: self.spec.tag, **extra}

    def spawn(self, i: int, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start argv on device i: in its namespace and its cgroup, output to LOG_DIR/name.log."""
        group = self.groups[i]
        logf = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(self.net.exec_prefix(self.net.device(i)) + argv, stdout=logf,
                                stderr=subprocess.STDOUT, env=env or self.env(), cwd=REPO,
                                stdin=subprocess.DEVNULL, preexec_fn=group.attach_self, start_new_session=True)
        logf.close()
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run argv to the end in device i's namespace, outside its cgroup (a client or a measurement)."""
        res = subprocess.run(self.net.exec_prefix(self.net.device(i)) + argv, capture_output=True, text=True,
                             env=env or self.env(), cwd=REPO, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:4])} ... exited {res.returncode}: {res.stderr.strip()[-1500:]}")
        return res

    def dead(self) -> list[str]:
        return [" ".join(p.args[4:7]) + f" (exit {p.returncode})" for p in self.procs if p.poll() is not None]


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def terminate(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(grace_s)


def _owner_alive(tag: str) -> bool:
    state = STATE_DIR / f"{tag}.json"
    try:
        pid = int(json.loads(state.read_text())["owner"])
    except (OSError, ValueError, KeyError):
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def cleanup(everything: bool) -> list[str]:
    """Remove what testbeds left behind: those whose owner is gone, or every one with `everything`.
    Returns the tags removed."""
    found = {netns.tag_of(ns) for ns in netns.existing()} | cgroups.tags()
    if STATE_DIR.is_dir():
        found |= {p.stem for p in STATE_DIR.glob("*.json")}
    removed = []
    for tag in sorted(found):
        if not everything and _owner_alive(tag):
            continue
        for ns in netns.existing():
            if netns.tag_of(ns) == tag:
                netns.kill_namespace(ns)
        cgroups.remove_tag(tag)
        kill_marked(tag)
        (STATE_DIR / f"{tag}.json").unlink(missing_ok=True)
        removed.append(tag)
    return removed


def marked_pids(tag: str) -> list[int]:
    """Processes whose environment carries testbed `tag`'s marker."""
    needle = f"{MARKER}={tag}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass   # gone meanwhile, or not ours to read
    return found


def kill_marked(tag: str) -> None:
    """SIGKILL any process still carrying tag's marker (one started outside the namespaces, e.g. `run`'s)."""
    for pid in marked_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def leftovers(tag: str) -> list[str]:
    """What of testbed `tag` still exists (empty after a clean teardown)."""
    left = [f"netns {ns}" for ns in netns.existing() if netns.tag_of(ns) == tag]
    left += [f"process {pid}" for pid in marked_pids(tag)]
    left += [f"cgroup {tag}" for t in cgroups.tags() if t == tag]
    left += [f"state {p}" for p in [STATE_DIR / f"{tag}.json"] if p.exists()]
    return left
