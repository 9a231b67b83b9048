"""CurveZMQ keys and sockets: only nodes holding the cluster's keys can talk, tested on 127.0.0.1."""
from __future__ import annotations

import logging
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from click.testing import CliRunner

from flowedge.errors import ConfigError
from flowedge.transport import security
from flowedge.transport.channel import recv_msg, send_msg
from flowedge.transport.keys_commands import keys as keys_cli
from flowedge.transport.protocol import Reset

torch.set_num_threads(1)
NOT_DELIVERED_MS = 600


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def cluster(tmp_path: Path) -> security.ClusterKeys:
    security.init_keys(tmp_path / "cluster")
    return security.load_keys(tmp_path / "cluster")


@pytest.fixture
def stranger(tmp_path: Path) -> security.ClusterKeys:
    security.init_keys(tmp_path / "other")
    return security.load_keys(tmp_path / "other")


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# ---------------------------------------------------------------- key files
def test_init_writes_a_loadable_key_pair_with_private_permissions(tmp_path: Path) -> None:
    paths = security.init_keys(tmp_path / "k")
    assert paths.secret.name == "cluster.key_secret" and paths.public.name == "cluster.key"
    assert _mode(paths.secret) == 0o600
    assert _mode(paths.secret.parent) == 0o700
    public, secret = zmq.auth.load_certificate(paths.secret)
    assert zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(paths.public) == (public, None)  # public file holds no secret
    keys = security.load_keys(tmp_path / "k")
    assert keys.public == public and keys.secret == secret and keys.allowed == {public}
    assert secret.decode() not in repr(keys)


def test_init_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    security.init_keys(tmp_path)
    first = security.load_keys(tmp_path).public
    with pytest.raises(ConfigError, match="--force"):
        security.init_keys(tmp_path)
    security.init_keys(tmp_path, force=True)
    assert security.load_keys(tmp_path).public != first
    assert _mode(tmp_path / "cluster.key_secret") == 0o600


def test_missing_keys_tell_the_user_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run `flowedge keys init` on one node and copy that directory"):
        security.load_keys(tmp_path / "nowhere")


def test_default_directory_follows_flowedge_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    assert security.default_keys_dir() == tmp_path / "keys"
    security.init_keys()
    assert (tmp_path / "keys" / "cluster.key_secret").is_file()
    monkeypatch.delenv("FLOWEDGE_HOME")
    assert security.default_keys_dir() == Path("~/.cache/flowedge/keys").expanduser()


@pytest.mark.parametrize(
    "text",
    ["garbage\n", 'curve\n    public-key = "abc"\n    secret-key = "def"\n'],
)
def test_corrupt_key_file_is_a_config_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "cluster.key_secret").write_text(text)
    with pytest.raises(ConfigError):
        security.load_keys(tmp_path)


def test_mismatched_pair_is_a_config_error(tmp_path: Path) -> None:
    public, _ = zmq.curve_keypair()
    _, secret = zmq.curve_keypair()
    (tmp_path / "cluster.key_secret").write_text(
        f'curve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n'
    )
    with pytest.raises(ConfigError, match="do not belong together"):
        security.load_keys(tmp_path)


def test_world_readable_secret_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    paths = security.init_keys(tmp_path)
    paths.secret.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger=security.__name__):
        security.load_keys(tmp_path)
    assert "readable by others" in caplog.text


# ---------------------------------------------------------------- real sockets on 127.0.0.1
def _server(ctx: zmq.Context, keys: security.ClusterKeys | None, auth) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    if keys is not None:
        security.secure_server(sock, keys, auth)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def _client(ctx: zmq.Context, addr: str, keys: security.ClusterKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        security.secure_client(sock, keys)
    sock.connect(addr)
    return sock


def _delivered(server: zmq.Socket, client: zmq.Socket, timeout_ms: int) -> bool:
    send_msg(client, Reset(run_id=3))
    if not server.poll(timeout_ms):
        return False
    identity, *frames = server.recv_multipart(copy=False)
    return Reset.from_frames(frames) == Reset(run_id=3)


def test_nodes_with_the_cluster_keys_talk_both_ways(ctx: zmq.Context, cluster) -> None:
    auth = security.start_authenticator(ctx, cluster)
    try:
        server, addr = _server(ctx, cluster, auth)
        client = _client(ctx, addr, cluster)
        send_msg(client, Reset(run_id=3))
        assert server.poll(5000)
        identity, *frames = server.recv_multipart(copy=False)
        assert Reset.from_frames(frames) == Reset(run_id=3)
        server.send_multipart([identity.bytes, *Reset(run_id=4).to_frames()])
        assert recv_msg(client, 5000) == Reset(run_id=4)
    finally:
        auth.stop()


def _wait_for(caplog: pytest.LogCaptureFixture, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in caplog.text:
            return True
        time.sleep(0.02)
    return False


def test_node_with_foreign_keys_cannot_send_and_zap_logs_it(
    ctx: zmq.Context, cluster, stranger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=security.__name__)
    auth = security.start_authenticator(ctx, cluster)
    try:
        server, addr = _server(ctx, cluster, auth)
        intruder = ctx.socket(zmq.DEALER)
        intruder.linger = 0
        intruder.curve_publickey, intruder.curve_secretkey = stranger.public, stranger.secret
        intruder.curve_serverkey = cluster.public  # it even knows the (public) server key
        intruder.connect(addr)
        assert not _delivered(server, intruder, NOT_DELIVERED_MS)
        assert _wait_for(caplog, "ZAP refused a CURVE client with public key " + stranger.public.decode(), 2.0)
        legit = _client(ctx, addr, cluster)  # the server still serves members
        assert _delivered(server, legit, 5000)
    finally:
        auth.stop()


def test_node_without_curve_cannot_send(ctx: zmq.Context, cluster) -> None:
    auth = security.start_authenticator(ctx, cluster)
    try:
        server, addr = _server(ctx, cluster, auth)
        assert not _delivered(server, _client(ctx, addr, None), NOT_DELIVERED_MS)
    finally:
        auth.stop()


def test_impostor_server_without_the_secret_cannot_receive(ctx: zmq.Context, cluster, stranger) -> None:
    auth = security.start_authenticator(ctx, stranger)
    try:
        impostor, addr = _server(ctx, stranger, auth)
        member = _client(ctx, addr, cluster)  # expects the cluster's server key
        assert not _delivered(impostor, member, NOT_DELIVERED_MS)
    finally:
        auth.stop()


def test_curve_server_needs_a_live_authenticator(ctx: zmq.Context, cluster) -> None:
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    with pytest.raises(ConfigError, match="authenticator"):
        security.secure_server(sock, cluster, None)
    auth = security.start_authenticator(ctx, cluster)
    auth.stop()
    with pytest.raises(ConfigError, match="authenticator"):
        security.secure_server(sock, cluster, auth)


def test_security_bundle_secure_and_insecure(
    ctx: zmq.Context, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    security.init_keys(tmp_path)
    sec = security.Security.start(ctx, tmp_path, insecure=False)
    try:
        server = ctx.socket(zmq.ROUTER)
        sec.server(server)
        assert server.curve_server
        client = ctx.socket(zmq.DEALER)
        sec.client(client)
        assert client.mechanism == zmq.CURVE and not client.curve_server
    finally:
        sec.stop()
    with caplog.at_level(logging.WARNING, logger=security.__name__):
        plain = security.Security.start(ctx, tmp_path / "absent", insecure=True)
    assert "running without CurveZMQ (--insecure): anyone on the network can join" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING
    server, addr = _server(ctx, None, None)
    plain.server(server)
    client = _client(ctx, addr, None)
    plain.client(client)
    assert _delivered(server, client, 5000)


# ---------------------------------------------------------------- CLI
def test_keys_cli_init_and_show(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(keys_cli, ["init", "--dir", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    keys = security.load_keys(tmp_path / "k")
    assert keys.public.decode() in result.output
    shown = runner.invoke(keys_cli, ["show", "--dir", str(tmp_path / "k")])
    assert shown.exit_code == 0 and keys.public.decode() in shown.output
    assert keys.secret.decode() not in shown.output + result.output
    assert "mode 0600" in shown.output
    again = runner.invoke(keys_cli, ["init", "--dir", str(tmp_path / "k")])
    assert isinstance(again.exception, ConfigError)
    forced = runner.invoke(keys_cli, ["init", "--dir", str(tmp_path / "k"), "--force"])
    assert forced.exit_code == 0 and security.load_keys(tmp_path / "k").public != keys.public
