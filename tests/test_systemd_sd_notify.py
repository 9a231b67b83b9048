"""systemd's notify protocol: the Notifier against fake NOTIFY_SOCKETs, a real head and stage speaking it,
`flowedge keys init --owner`, and `systemd-analyze verify` on the shipped units."""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cluster_helpers import free_port_pair, logs, spawn_join
from flowedge.errors import ConfigError
from flowedge.systemd.sd_notify import Notifier, watchdog_interval_s
from flowedge.transport import security
from flowedge.transport.keys_commands import keys as keys_cli

UNITS = Path(__file__).resolve().parent.parent / "systemd"


def _listener(path: Path | None = None) -> tuple[socket.socket, str]:
    """A bound datagram socket standing in for systemd: (socket, the $NOTIFY_SOCKET value)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if path is None:   # abstract namespace: '@name' in the variable, a leading NUL on the wire
        name = f"flowedge-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind(b"\0" + name.encode())
        return sock, "@" + name
    sock.bind(str(path))
    return sock, str(path)


def _received(sock: socket.socket, until, timeout_s: float) -> list[str]:
    """Datagrams until `until(messages)` holds or the time is up."""
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    sock.settimeout(0.2)
    while time.monotonic() < deadline and not until(got):
        try:
            got.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    return got


# ---- the protocol ------------------------------------------------------------------------------------
def test_a_notifier_outside_systemd_does_nothing():
    n = Notifier(env={})
    assert not n.enabled and not n.send("READY=1")
    n.ready("x"), n.watchdog(), n.tick(lambda: pytest.fail("status computed outside systemd")), n.stopping()


@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "path"])
def test_ready_status_watchdog_and_stopping_reach_the_socket(tmp_path, abstract):
    sock, where = _listener(None if abstract else tmp_path / "notify")
    now = [0.0]
    n = Notifier(env={"NOTIFY_SOCKET": where, "WATCHDOG_USEC": "2000000"}, clock=lambda: now[0])
    try:
        assert n.watchdog_s == 1.0
        n.ready("serving, 0/2 stages ready")
        n.ready("serving, 1/2 stages ready")   # READY is sent once; later calls only update STATUS
        n.watchdog()
        n.watchdog()                           # within half the period: not resent
        now[0] = 1.5
        n.watchdog()
        n.status("serving, 1/2 stages ready")  # unchanged: not resent
        n.stopping()
        got = _received(sock, lambda g: len(g) >= 5, 5)
    finally:
        n.close()
        sock.close()
    assert got[0].split("\n")[:2] == ["READY=1", "STATUS=serving, 0/2 stages ready"]
    assert f"MAINPID={os.getpid()}" in got[0]
    assert got[1:] == ["STATUS=serving, 1/2 stages ready", "WATCHDOG=1", "WATCHDOG=1",
                       "STOPPING=1\nSTATUS=stopping"]


def test_watchdog_settings_follow_sd_watchdog_enabled():
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None   # someone else's
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({}) is None


def test_a_vanished_manager_never_raises(tmp_path):
    n = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert n.enabled and not n.send("READY=1")
    n.ready(), n.stopping()


# ---- real processes ------------------------------------------------------------------------------------
def test_a_manager_that_stops_reading_never_blocks_the_node(tmp_path):
    """Before: sendto blocked once the manager's queue (10 datagrams) was full, and the head's loop with
    it: a head that stopped answering HELLO while a test (or a wedged systemd) was not reading."""
    sock, addr = _listener(tmp_path / "full")
    notifier = Notifier(env={"NOTIFY_SOCKET": addr})
    sent: list[bool] = []
    worker = threading.Thread(target=lambda: sent.extend(notifier.send(f"STATUS={i}") for i in range(200)),
                              daemon=True)
    worker.start()
    worker.join(10)
    try:
        assert not worker.is_alive(), "send blocked on a full notify socket"
        assert sent[:5] == [True] * 5 and False in sent   # the first fit; the rest were dropped, not waited on
    finally:
        sock.close()


def test_a_real_head_and_stage_speak_the_notify_protocol(tiny_pair, tmp_path):
    base, draft = tiny_pair
    home = tmp_path / "home"
    security.init_keys(home / "keys")
    addr = f"127.0.0.1:{free_port_pair()}"
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'role = "head"\nhead = "{addr}"\nmodel = "{base}"\ndraft = "{draft}"\nstages = 1\n'
                   f'threads = 1\nheartbeat_ms = 500\n')
    head_sock, head_addr = _listener()
    stage_sock, stage_addr = _listener(tmp_path / "stage-notify")
    watchdog = {"WATCHDOG_USEC": "1000000"}   # a ping at least every 0.5 s
    env = {**os.environ, "FLOWEDGE_HOME": str(home)}
    with open(tmp_path / "head.log", "ab") as logf:
        head = subprocess.Popen([sys.executable, "-m", "flowedge", "-v", "serve", "--config", str(cfg)],
                                stdout=logf, stderr=subprocess.STDOUT,
                                env={**env, "NOTIFY_SOCKET": head_addr, **watchdog})
    stage = None
    try:
        got = _received(head_sock, lambda g: any(m.startswith("READY=1") for m in g), 120)
        assert any(m.startswith("READY=1") and "STATUS=waiting for stages, 0/1 stages ready" in m
                   for m in got), (got, logs(tmp_path))
        stage = spawn_join(addr, "--node-id", "edge-1", log_path=tmp_path / "stage.log",
                           env={"FLOWEDGE_HOME": str(home), "NOTIFY_SOCKET": stage_addr, **watchdog})
        s_got = _received(stage_sock, lambda g: any(m.startswith("READY=1") for m in g)
                          and g.count("WATCHDOG=1") >= 2, 120)
        ready = next(m for m in s_got if m.startswith("READY=1"))
        assert "STATUS=serving stage 1, layers [0, 4)" in ready and f"MAINPID={stage.pid}" in ready, s_got
        got += _received(head_sock, lambda g: "STATUS=serving, 1/1 stages ready, 0 queued, 0 running" in g, 30)
        assert "STATUS=serving, 1/1 stages ready, 0 queued, 0 running" in got, (got, logs(tmp_path))
        got += _received(head_sock, lambda g: g.count("WATCHDOG=1") >= 3, 10)
        assert got.count("WATCHDOG=1") >= 3
        stage.send_signal(signal.SIGTERM)
        assert stage.wait(20) == 0
        assert "STOPPING=1\nSTATUS=stopping" in _received(stage_sock, lambda g: any("STOPPING=1" in m for m in g), 5)
        head.send_signal(signal.SIGTERM)
        head.wait(20)
        assert any("STOPPING=1" in m for m in _received(head_sock, lambda g: any("STOPPING=1" in m for m in g), 5))
    finally:
        for proc in (stage, head):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        head_sock.close()
        stage_sock.close()


# ---- keys for the service user ---------------------------------------------------------------------------
def test_keys_init_owner_hands_the_keys_to_the_service_account(tmp_path):
    me = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    out = CliRunner().invoke(keys_cli, ["init", "--dir", str(tmp_path / "k"), "--owner", f"{me}:{group}"])
    assert out.exit_code == 0, out.output
    paths = security.key_paths(tmp_path / "k")
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (paths.secret.parent, paths.secret, paths.public)}
    assert list(modes.values()) == [0o750, 0o640, 0o644]
    assert all(p.stat().st_uid == os.getuid() and p.stat().st_gid == os.getgid() for p in modes)
    security.load_keys(tmp_path / "k")   # still a valid pair
    # On existing keys, --owner alone changes only owner and modes (user only: owner-only modes).
    out = CliRunner().invoke(keys_cli, ["init", "--dir", str(tmp_path / "k"), "--owner", me])
    assert out.exit_code == 0 and "now belongs to" in out.output, out.output
    assert stat.S_IMODE(paths.secret.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="no such user"):
        security.give_keys_to("no-such-user-flowedge", tmp_path / "k")


# ---- the units -------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", ["flowedge-head.service", "flowedge-stage.service"])
def test_units_pass_systemd_analyze_verify(tmp_path, unit):
    text = (UNITS / unit).read_text()
    for key in ("Type=notify", "WatchdogSec=", "NotifyAccess=main", "keys init --owner"):
        assert key in text
    # verify checks that ExecStart's program exists: point it at one that does on this machine.
    (tmp_path / unit).write_text(text.replace("/opt/flowedge/.venv/bin/flowedge", shutil.which("true") or "/bin/true"))
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit)], capture_output=True, text=True,
                         timeout=60)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if unit in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def _runnable(tmp_path: Path, unit: str) -> Path:
    """The unit with ExecStart on a program that exists here (verify and security check it)."""
    path = tmp_path / unit
    path.write_text((UNITS / unit).read_text().replace("/opt/flowedge/.venv/bin/flowedge", shutil.which("true")))
    return path


def _security_supports_offline() -> bool:
    if shutil.which("systemd-analyze") is None:
        return False
    out = subprocess.run(["systemd-analyze", "security", "--help"], capture_output=True, text=True, timeout=30)
    return "--offline" in out.stdout


@pytest.mark.skipif(not _security_supports_offline(),
                    reason="no systemd-analyze with security --offline (systemd >= 250)")
@pytest.mark.parametrize("unit", ["flowedge-head.service", "flowedge-stage.service", "flowedge-http.service"])
def test_units_score_at_most_2_5_in_systemd_analyze_security(tmp_path, unit):
    """Before: 8.5 EXPOSED for all three."""
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(_runnable(tmp_path, unit))],
                         capture_output=True, text=True, timeout=60)
    last = (out.stdout + out.stderr).strip().splitlines()[-1]
    score = float(last.split("exposure level for")[1].split(":")[1].split()[0])
    assert score <= 2.5, out.stdout[-3000:]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_http_unit_is_notify_and_a_missing_env_file_is_no_restart_loop(tmp_path):
    text = (UNITS / "flowedge-http.service").read_text()
    unit, service = text.split("[Service]")
    assert "AssertPathExists=/etc/flowedge/http.env" in unit           # fails once, is not restarted
    assert "EnvironmentFile=/etc/flowedge/http.env" in service and "EnvironmentFile=-" not in service
    assert "Type=notify" in service and "RestartPreventExitStatus=78" in service
    out = subprocess.run(["systemd-analyze", "verify", str(_runnable(tmp_path, "flowedge-http.service"))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "flowedge-http" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_install_writes_units_sysusers_and_notes_for_this_install(tmp_path):
    """Before: the units were not in the wheel, nothing created User=flowedge, Documentation= named a file
    nothing installed."""
    from flowedge import systemd

    written = systemd.install(tmp_path, flowedge_bin="/srv/venv/bin/flowedge")
    units = [p for p in written if p.suffix == ".service"]
    assert len(units) == 3 and all("ExecStart=/srv/venv/bin/flowedge " in p.read_text() for p in units)
    sysusers = tmp_path / "usr/lib/sysusers.d/flowedge.conf"
    assert sysusers.read_text().splitlines()[-1].split()[:2] == ["u", "flowedge"]
    docs = {line.split("=", 1)[1] for p in units for line in p.read_text().splitlines()
            if line.startswith("Documentation=file://")}
    assert docs == {"file:///usr/share/doc/flowedge/systemd.md"}
    assert (tmp_path / "usr/share/doc/flowedge/systemd.md").is_file()
    root = Path(__file__).resolve().parent.parent   # the wheel maps systemd/ to flowedge.systemd.units
    setup = (root / "setup.cfg").read_text()
    units_data = setup.split("flowedge.systemd.units =", 1)[1].split("\n\n", 1)[0]
    assert "*.service" in units_data and "*.conf" in units_data and "*.md" in units_data
    assert '"flowedge.systemd.units": "systemd"' in (root / "setup.py").read_text()


def test_the_http_server_notifies_systemd_when_it_listens_and_when_it_stops(tmp_path):
    import threading

    from flowedge.api.server import build_server
    from flowedge.api.settings import ApiSettings

    sock, address = _listener(tmp_path / "notify")
    os.environ["NOTIFY_SOCKET"] = address
    try:
        server = build_server(ApiSettings(head="127.0.0.1:9", insecure=True), "127.0.0.1", 0, log_level="warning")
    finally:
        del os.environ["NOTIFY_SOCKET"]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        got = _received(sock, lambda m: any("READY=1" in x for x in m), 15)
        assert any("READY=1" in m and "STATUS=serving the API on 127.0.0.1:0" in m for m in got), got
    finally:
        server.should_exit = True
        thread.join(10)
    assert any("STOPPING=1" in m for m in _received(sock, lambda m: any("STOPPING=1" in x for x in m), 5))
