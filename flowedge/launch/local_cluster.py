"""`flowedge up` / `down`: a head and N-1 stage processes on this machine, real sockets between them.

Each node is its own `python -m flowedge` process (spawned, not forked: no torch state is shared), with
its own torch thread count, its log in `$FLOWEDGE_HOME/run/up-PORT/`, and the cluster keys from
`$FLOWEDGE_HOME/keys` (created on first use). A detached cluster records its pids in `cluster.json`
so `flowedge down` can stop it, and runs a supervisor process (launch/supervisor.py) that starts a stage
that dies again; in the foreground, `up` supervises itself.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flowedge.errors import ConfigError, FlowedgeError
from flowedge.home import flowedge_home
from flowedge.node.node_config import DEFAULT_WIRE_DTYPE, NodeConfig
from flowedge.transport import security
from flowedge.transport.addresses import DEFAULT_PORT

log = logging.getLogger(__name__)

STATE_FILE = "cluster.json"
SUPERVISOR_LOG = "supervisor.log"

# Idle OpenMP threads sleep instead of spinning: several processes of one box share its cores (a user's
# own OMP_WAIT_POLICY wins).
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "passive"}


def node_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """A node process's environment: `threads` for OpenMP and MKL, idle threads asleep unless the user's
    own OMP_WAIT_POLICY says otherwise."""
    return {**PASSIVE_WAIT, **(os.environ if base is None else base),
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@dataclass
class LocalClusterSpec:
    nodes: int = 3
    model: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    strategy: str = "auto"
    port: int = DEFAULT_PORT
    threads: int = 0                 # per process; 0 = every core (see per_process_threads)
    insecure: bool = False
    wire_dtype: str = DEFAULT_WIRE_DTYPE
    quant: str = "int4"
    draft_quant: str = "auto"
    layers: list[int] = field(default_factory=list)
    tree_nodes: int = 0
    tree_size: str = "profile"        # flowspec's first tree: sized from `device`'s profile | paper
    lm_head_at: str = "auto"
    predraft: str = "off"            # off | idle | drafter (NodeConfig.predraft)
    drafter: bool = False            # one drafter process too (`flowedge join --drafter`), last in `procs`
    device: str = "x86-cpu"          # every node's device profile (status; `auto` lm_head placement)
    heartbeat_ms: int = 500          # liveness, as in NodeConfig (node/node_config.py)
    stage_timeout_s: float = 2.0
    client_timeout_s: float = 10.0
    recovery_s: float = 30.0
    replan_on_loss: bool = True      # re-plan onto the stages left when one stays away (node/shrink.py)
    stall_timeout_s: float = 120.0
    max_concurrent: int = 4          # requests in the pipeline at once
    kv_budget_tokens: int = 0        # per stage; 0 = from free memory
    data_port: str = "0"             # the stages' data ports: "0" (any) or a range "5560-5569" (NodeConfig.data_port)
    standby_addr: str = ""           # a standby head's address: the stages try it too (`join --heads`)

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ConfigError(f"a cluster needs at least 2 nodes (head + 1 stage), got {self.nodes}")
        # the head's own checks (strategy, model, device, quant...) here, before any process starts
        NodeConfig(role="head", head=self.addr, model=self.model, draft=self.draft, strategy=self.strategy,
                   stages=self.nodes - 1, layers=list(self.layers), wire_dtype=self.wire_dtype, quant=self.quant,
                   draft_quant=self.draft_quant, tree_size=self.tree_size, lm_head_at=self.lm_head_at,
                   predraft=self.predraft, device=self.device)
        lo, hi = NodeConfig(data_port=self.data_port).data_ports()
        if lo and hi - lo + 1 < self.nodes - 1:
            raise ConfigError(f"--data-port {self.data_port}: {self.nodes - 1} stages need as many ports")

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def per_process_threads(self) -> int:
        """Every core for each process: a pipeline's processes mostly take turns (one token crosses the
        stages one after another), so each one's turn runs on all cores, and with idle OpenMP threads
        asleep (PASSIVE_WAIT) the turns that do overlap (concurrent requests) share the cores without
        spinning. Measured on the 2-core box, real pair, 3 nodes, 64 tokens: one request 11.3-11.7 ->
        13.8-14.8 tok/s, three at once 13-16 -> 17.5 tok/s; spinning threads instead collapsed three at
        once to 2.7 tok/s (docs/bench/native-runtime/README.md)."""
        return self.threads or max(1, os.cpu_count() or 1)


@dataclass
class LocalCluster:
    spec: LocalClusterSpec
    run_dir: Path
    procs: list[subprocess.Popen]
    commands: list[list[str]] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    supervisor: subprocess.Popen | None = None   # `up --detach`: the process restarting dead stages

    @property
    def names(self) -> list[str]:
        return node_names(len(self.procs), self.spec.drafter)

    def log_paths(self) -> list[Path]:
        return [self.run_dir / f"{n}.log" for n in self.names]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def dead(self) -> list[str]:
        return [f"{n} (exit {p.returncode}, log {self.run_dir / (n + '.log')})"
                for n, p in zip(self.names, self.procs) if p.poll() is not None]

    def failure(self) -> str:
        """Why the first node that exited did: the last `error:` line of its log (the CLI's one line),
        else its exit status and log."""
        for name, p in zip(self.names, self.procs):
            if p.poll() is None:
                continue
            logfile = self.run_dir / f"{name}.log"
            lines = logfile.read_text(errors="replace").splitlines() if logfile.is_file() else []
            errors = [line for line in lines if line.startswith("error: ")]
            if errors:
                return f"{name}: {errors[-1].removeprefix('error: ')}"
            tail = next((line for line in reversed(lines) if line.strip()), "")
            return f"{name} exited with status {p.returncode}: {tail[-300:]} (log {logfile})"
        return ""

    def restart(self, k: int, detach: bool = False) -> subprocess.Popen:
        """Start node k (0 = the head) again with its first command line (same node id, same slot)."""
        name = self.names[k]
        logf = open(self.run_dir / f"{name}.log", "ab")
        self.procs[k] = subprocess.Popen(self.commands[k], stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=detach, stdin=subprocess.DEVNULL)
        logf.close()
        self._record()
        return self.procs[k]

    def _record(self) -> None:
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps({
            "addr": self.spec.addr, "pids": [p.pid for p in self.procs], "names": self.names,
            "insecure": self.spec.insecure, "commands": self.commands,
            "supervisor": self.supervisor.pid if self.supervisor is not None else None}) + "\n")
        tmp.replace(self.run_dir / STATE_FILE)

    def supervise_detached(self) -> None:
        """Start the supervisor of a detached cluster (`flowedge supervise`), in its own session and log."""
        with open(self.run_dir / SUPERVISOR_LOG, "ab") as logf:
            self.supervisor = subprocess.Popen(
                [sys.executable, "-m", "flowedge", "-v", "supervise", "--port", str(self.spec.port)],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        self._record()

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the head to stop everything, then make sure every child is gone."""
        if self.supervisor is not None and self.supervisor.poll() is None:
            _reap([self.supervisor.pid], 0.0, [self.supervisor])
        if self.procs and self.procs[0].poll() is None:
            _request_shutdown(self.spec.addr, self.spec.insecure, "flowedge up is stopping")
        for p in self.procs:   # a stopped (SIGSTOP) node must be able to exit
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        _reap([p.pid for p in self.procs], grace_s, self.procs)
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)


def node_names(n: int, drafter: bool = False) -> list[str]:
    """The processes' names (and log files): the head, its stages, then the drafter if there is one."""
    stages = n - 1 - drafter
    return ["head"] + [f"stage-{k}" for k in range(1, stages + 1)] + (["drafter"] if drafter else [])


def start(spec: LocalClusterSpec, detach: bool = False) -> LocalCluster:
    home = flowedge_home()
    run_dir = home / "run" / f"up-{spec.port}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / STATE_FILE).is_file() and _any_alive(json.loads((run_dir / STATE_FILE).read_text())["pids"]):
        raise ConfigError(f"a local cluster already runs on port {spec.port}; `{down_command(spec.port)}` first")
    for port in (spec.port, spec.port + 1):   # the head's two ports, checked before any process starts
        check_free(port)
    if not spec.insecure and not security.key_paths(home / "keys").secret.is_file():
        security.init_keys(home / "keys")
        log.info("created cluster keys in %s", home / "keys")
    threads = spec.per_process_threads()
    head_cfg = run_dir / "head.toml"
    head_cfg.write_text("\n".join([
        'role = "head"', f'head = "{spec.addr}"', 'node_id = "head"', f"threads = {threads}",
        f'model = "{spec.model}"', f'draft = "{spec.draft}"', f"stages = {spec.nodes - 1}",
        f"layers = {list(spec.layers)}", f'strategy = "{spec.strategy}"', f'wire_dtype = "{spec.wire_dtype}"',
        f'quant = "{spec.quant}"', f'draft_quant = "{spec.draft_quant}"', f"tree_nodes = {spec.tree_nodes}",
        f'tree_size = "{spec.tree_size}"', f'lm_head_at = "{spec.lm_head_at}"',
        f"insecure = {str(spec.insecure).lower()}",
        f"heartbeat_ms = {spec.heartbeat_ms}", f"stage_timeout_s = {spec.stage_timeout_s}",
        f"client_timeout_s = {spec.client_timeout_s}", f"recovery_s = {spec.recovery_s}",
        f"replan_on_loss = {str(spec.replan_on_loss).lower()}",
        f"stall_timeout_s = {spec.stall_timeout_s}", f"max_concurrent = {spec.max_concurrent}",
        f"kv_budget_tokens = {spec.kv_budget_tokens}", f'device = "{spec.device}"',
        f'predraft = "{spec.predraft}"',
    ]) + "\n")
    env = node_env(threads)
    base = [sys.executable, "-m", "flowedge", "-v"]
    commands = [base + ["serve", "--config", str(head_cfg)]]
    joined = ["--threads", str(threads), "--device", spec.device, "--same-host",
              f"--stage-timeout={spec.stage_timeout_s}", f"--heartbeat-ms={spec.heartbeat_ms}",
              *(["--insecure"] if spec.insecure else [])]   # what every stage and the drafter are told
    heads = ["--heads", f"{spec.addr},{spec.standby_addr}"] if spec.standby_addr else [spec.addr]
    for k in range(1, spec.nodes):
        commands.append(base + ["join", *heads, "--node-id", f"stage-{k}", "--stage", str(k),
                                f"--data-port={spec.data_port}", *joined])
    if spec.drafter:
        commands.append(base + ["join", spec.addr, "--drafter", "--node-id", "drafter", *joined])
    procs = []
    for name, cmd in zip(node_names(len(commands), spec.drafter), commands):
        logf = open(run_dir / f"{name}.log", "ab")
        procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=detach, stdin=subprocess.DEVNULL))
        logf.close()
    cluster = LocalCluster(spec, run_dir, procs, commands, env)
    cluster._record()
    log.info("started %d processes (%d torch threads each); logs in %s", len(procs), threads, run_dir)
    return cluster


def down_command(port: int) -> str:
    return "flowedge down" + ("" if port == DEFAULT_PORT else f" --port {port}")


def check_free(port: int) -> None:
    """ConfigError in one line if something listens on 127.0.0.1:`port` already."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a port in TIME_WAIT is free (zmq binds so)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise ConfigError(f"port {port} on 127.0.0.1 is taken ({err.strerror}); pick another with "
                              f"`flowedge up --port PORT` (the head uses PORT and PORT+1)") from None


def recorded_ports() -> list[int]:
    """The ports of the local clusters `up --detach` recorded under $FLOWEDGE_HOME/run."""
    found = (flowedge_home() / "run").glob(f"up-*/{STATE_FILE}")
    return sorted(int(p.parent.name.removeprefix("up-")) for p in found if p.parent.name[3:].isdigit())


def down(port: int | None = None, grace_s: float = 10.0) -> str:
    """Stop a detached local cluster (the only one recorded when `port` is None) and its supervisor;
    returns a one-line report of what was running and stopped, and what had already exited."""
    if port is None:
        ports = recorded_ports()
        if len(ports) > 1:
            raise ConfigError(f"local clusters run on ports {', '.join(map(str, ports))}: "
                              f"`flowedge down --port PORT` stops one")
        port = ports[0] if ports else DEFAULT_PORT
    state_file = flowedge_home() / "run" / f"up-{port}" / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(f"no detached local cluster recorded on port {port} ({state_file} missing; "
                          f"`flowedge up --detach` records one)")
    supervisor = json.loads(state_file.read_text()).get("supervisor")
    if supervisor and _alive(supervisor):   # first, or it would start again what is being stopped
        _reap([supervisor], 0.0)
    state = json.loads(state_file.read_text())   # as the supervisor left it: the pids of its restarts
    pids = state["pids"]
    names = (state.get("names") or node_names(len(pids)))[:len(pids)]
    running = [(name, pid) for name, pid in zip(names, pids) if _alive(pid)]
    if running and _alive(pids[0]):
        _request_shutdown(state["addr"], state.get("insecure", False), "flowedge down")
    killed = _reap([pid for _, pid in running], grace_s)
    state_file.unlink(missing_ok=True)
    return stop_report(state["addr"], [n for n, _ in running], [n for n in names if n not in dict(running)],
                       killed, grace_s)


def stop_report(addr: str, stopped: list[str], gone: list[str], killed: int, grace_s: float) -> str:
    """`down`'s line: the processes it stopped by name, how many had to be killed, which were gone already."""
    if not stopped:
        return f"nothing was running at {addr}" + (f": {', '.join(gone)} had already exited" if gone else "") + \
            "; its record is removed"
    line = f"stopped the cluster at {addr}: {len(stopped)} process{'es' if len(stopped) > 1 else ''} " \
           f"({', '.join(stopped)})"
    if killed:
        line += f", {killed} killed after {grace_s:g} s"
    return line + (f"; {', '.join(gone)} had already exited" if gone else "")


def _request_shutdown(addr: str, insecure: bool, reason: str) -> None:
    """Ask the head to stop itself and its stages; the caller signals whatever is left."""
    from flowedge.client.sync_client import Client

    try:
        with Client(addr, insecure=insecure, timeout_s=3.0) as c:
            c.shutdown(reason)
    except FlowedgeError as err:
        log.warning("head did not take the shutdown request (%s); signalling the processes", err)


def _any_alive(pids: list[int]) -> bool:
    return any(_alive(pid) for pid in pids)


def _alive(pid: int, procs: dict | None = None) -> bool:
    if procs and pid in procs:
        return procs[pid].poll() is None
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:   # a zombie child of ours counts as gone
        return not os.waitpid(pid, os.WNOHANG)[0]
    except ChildProcessError:
        return True


def _reap(pids: list[int], grace_s: float, popens: list[subprocess.Popen] | None = None) -> int:
    """Wait for pids to exit; SIGTERM then SIGKILL the stragglers. Returns how many had to be killed."""
    procs = {p.pid: p for p in popens or []}
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, procs) for p in pids):
        time.sleep(0.1)
    killed = 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        stragglers = [p for p in pids if _alive(p, procs)]
        for pid in stragglers:
            killed += sig == signal.SIGKILL
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        t = time.monotonic() + 3.0
        while time.monotonic() < t and any(_alive(p, procs) for p in stragglers):
            time.sleep(0.1)
    for p in procs.values():
        p.poll()
    return killed
