"""CurveZMQ on every socket: the cluster's keys, socket setup and the ZAP gate.

Scheme: one Curve25519 key pair per cluster, made once by `flowedge keys init` and copied (the whole
directory) to every node. Every node uses it both as its server key (binding sockets) and as its
client key (connecting sockets, with the cluster public key as the server key). Why it is sound:
- a connecting peer must prove it holds the secret key of the public key it presents (CurveZMQ's
  vouch box), and the ZAP handler on every server socket admits only public keys in the cluster's
  allowed set (the cluster public key): without `cluster.key_secret` a peer cannot join or send;
- a binding peer must hold the secret key matching the cluster public key or no client ever
  completes the handshake with it: an impostor without the secret cannot receive;
- each connection is encrypted and authenticated with ephemeral keys (forward secrecy).
Limits: every holder of the secret is a full member (no per-node identity or revocation; rotate with
`keys init --force` and copy the directory again). libzmq lets a Curve server admit ANY client when no
ZAP handler runs, so `secure_server` refuses a socket without a live authenticator.

Files (zmq.auth certificate format, readable by `zmq.auth.load_certificate`): `cluster.key` (public)
and `cluster.key_secret` (mode 0600) in `$FLOWEDGE_HOME/keys` (FLOWEDGE_HOME defaults to
~/.cache/flowedge). `--insecure` skips all of this for a lab network and logs a warning.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from flowedge.errors import ConfigError
from flowedge.home import flowedge_home

log = logging.getLogger(__name__)

KEY_NAME = "cluster"
INSECURE_WARNING = "running without CurveZMQ (--insecure): anyone on the network can join"
_HOW_TO = "run `flowedge keys init` on one node and copy that directory to every node"


@dataclass(frozen=True, slots=True)
class KeyPaths:
    public: Path
    secret: Path


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    """The cluster key pair (z85 bytes) and the client public keys a server admits."""

    public: bytes
    secret: bytes = field(repr=False)
    allowed: frozenset[bytes]


def default_keys_dir() -> Path:
    """$FLOWEDGE_HOME/keys (default ~/.cache/flowedge/keys)."""
    return flowedge_home() / "keys"


def key_paths(directory: Path | str | None = None) -> KeyPaths:
    d = Path(directory) if directory is not None else default_keys_dir()
    return KeyPaths(public=d / f"{KEY_NAME}.key", secret=d / f"{KEY_NAME}.key_secret")


def _cert_text(public: bytes, secret: bytes | None) -> str:
    kind = "SECRET key: copy only to this cluster's nodes" if secret else "public key"
    lines = [f"#   flowedge cluster {kind}", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str) -> None:
    """Write atomically through a 0600 temp file, so the secret is never readable by others."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def init_keys(directory: Path | str | None = None, force: bool = False) -> KeyPaths:
    """Create the cluster key pair; ConfigError if keys exist and `force` is False."""
    paths = key_paths(directory)
    if not force and (paths.secret.exists() or paths.public.exists()):
        raise ConfigError(
            f"cluster keys already exist in {paths.secret.parent}; pass --force to replace them "
            "(every node must then get the new directory)"
        )
    paths.secret.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    _write_private(paths.secret, _cert_text(public, secret))
    _write_private(paths.public, _cert_text(public, None))
    paths.public.chmod(0o644)
    log.info("created cluster keys in %s", paths.secret.parent)
    return paths


def give_keys_to(owner: str, directory: Path | str | None = None) -> tuple[int, int]:
    """Hand the keys directory to the service account `owner` ("USER" or "USER:GROUP"), so a daemon
    running as that user (systemd's User=) can read them: owner-only modes (dir 0700, secret 0600),
    or group-readable ones (0750, 0640) when a GROUP is named. Returns (uid, gid); ConfigError for an
    unknown account or without the right to chown (run it as root)."""
    import grp
    import pwd

    user, _, group = owner.partition(":")
    try:
        account = pwd.getpwnam(user)
        gid = grp.getgrnam(group).gr_gid if group else account.pw_gid
    except KeyError:
        raise ConfigError(f"no such user or group: {owner!r}") from None
    paths = key_paths(directory)
    if not paths.secret.is_file():
        raise ConfigError(f"no cluster keys in {paths.secret.parent}: {_HOW_TO}")
    modes = {paths.secret.parent: 0o750 if group else 0o700, paths.secret: 0o640 if group else 0o600,
             paths.public: 0o644}
    try:
        for path, mode in modes.items():
            os.chown(path, account.pw_uid, gid)
            path.chmod(mode)
    except PermissionError as err:
        raise ConfigError(f"cannot give {paths.secret.parent} to {owner}: {err.strerror} (run as root)") from None
    log.info("cluster keys in %s now belong to %s", paths.secret.parent, owner)
    return account.pw_uid, gid


def load_keys(directory: Path | str | None = None) -> ClusterKeys:
    """Load the cluster keys; ConfigError telling the user what to do when they are missing or bad."""
    paths = key_paths(directory)
    if not paths.secret.is_file():
        raise ConfigError(
            f"no cluster keys in {paths.secret.parent}: {_HOW_TO} (or pass --insecure in a lab)"
        )
    try:
        public, secret = zmq.auth.load_certificate(paths.secret)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {paths.secret}: {err}") from err
    if secret is None or len(public) != 40 or len(secret) != 40:
        raise ConfigError(f"{paths.secret} holds no valid Curve key pair; {_HOW_TO}")
    try:
        derived = zmq.curve_public(secret)
    except (ValueError, zmq.ZMQError) as err:
        raise ConfigError(f"{paths.secret} holds a malformed secret key: {err}") from err
    if derived != public:
        raise ConfigError(f"{paths.secret}: public and secret keys do not belong together")
    mode = stat.S_IMODE(paths.secret.stat().st_mode)
    if mode & 0o007:   # group-readable is a choice (`keys init --owner USER:GROUP`); world-readable never
        log.warning("cluster secret key %s is readable by others (mode %o); chmod 600 it", paths.secret, mode)
    return ClusterKeys(public=public, secret=secret, allowed=frozenset({public}))


class _AllowedKeys:
    """ZAP credentials provider: admit a client only if its public key is in the allowed set."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._allowed:
            return True
        log.warning(
            "ZAP refused a CURVE client with public key %s: not this cluster's key "
            "(a node needs the cluster's keys directory to join)",
            key.decode(errors="replace"),
        )
        return False


def start_authenticator(ctx: zmq.Context, keys: ClusterKeys) -> ThreadAuthenticator:
    """Start the context's ZAP handler (one per context); call .stop() on shutdown."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(keys.allowed))
    return auth


def secure_server(sock: zmq.Socket, keys: ClusterKeys, auth: ThreadAuthenticator) -> None:
    """Make a socket a Curve server (call before bind); needs a live authenticator on its context."""
    if auth is None or not auth.is_alive() or auth.context is not sock.context:
        raise ConfigError("a CurveZMQ server socket needs a running authenticator on its context")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Make a socket a Curve client of any cluster node (call before connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


def warn_insecure() -> None:
    log.warning(INSECURE_WARNING)


@dataclass(frozen=True, slots=True)
class Security:
    """What a node applies to each socket: Curve with the cluster keys, or nothing (--insecure)."""

    keys: ClusterKeys | None
    auth: ThreadAuthenticator | None

    @classmethod
    def start(cls, ctx: zmq.Context, keys_dir: Path | str | None, insecure: bool) -> Security:
        if insecure:
            warn_insecure()
            return cls(keys=None, auth=None)
        keys = load_keys(keys_dir)
        return cls(keys=keys, auth=start_authenticator(ctx, keys))

    def server(self, sock: zmq.Socket) -> None:
        if self.keys is not None and self.auth is not None:
            secure_server(sock, self.keys, self.auth)

    def client(self, sock: zmq.Socket) -> None:
        if self.keys is not None:
            secure_client(sock, self.keys)

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
