"""`flowedge keys ...`: make and inspect the cluster's CurveZMQ keys (wired in by flowedge/cli.py)."""
from __future__ import annotations

import stat
from pathlib import Path

import click

from flowedge.transport import security

_DIR_HELP = "keys directory (default: $FLOWEDGE_HOME/keys, FLOWEDGE_HOME defaults to ~/.cache/flowedge)"


@click.group("keys")
def keys() -> None:
    """Manage the cluster's CurveZMQ keys (one key pair shared by every node)."""


@keys.command("init")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=None, help=_DIR_HELP)
@click.option("--force", is_flag=True, help="replace existing keys (every node then needs the new ones)")
@click.option("--owner", default=None, metavar="USER[:GROUP]",
              help="give the keys to the service account (systemd's User=/Group=); on existing keys without "
                   "--force only their owner and modes change. Needs root.")
def init(directory: Path | None, force: bool, owner: str | None) -> None:
    """Create the cluster key pair; then copy the directory to every node."""
    paths = security.key_paths(directory)
    if owner and not force and paths.secret.is_file():
        security.give_keys_to(owner, directory)
        click.echo(f"{paths.secret.parent} now belongs to {owner} "
                   f"(secret mode {stat.S_IMODE(paths.secret.stat().st_mode):04o})")
        return
    paths = security.init_keys(directory, force=force)
    if owner:
        security.give_keys_to(owner, directory)
    public = security.load_keys(paths.secret.parent).public.decode()
    mode = stat.S_IMODE(paths.secret.stat().st_mode)
    click.echo(f"created {paths.secret} (secret, mode {mode:04o}) and {paths.public}"
               + (f", owned by {owner}" if owner else ""))
    click.echo(f"cluster public key: {public}")
    click.echo(f"copy {paths.secret.parent} to the same path on every node, e.g. "
               f"scp -rp {paths.secret.parent} NODE:{paths.secret.parent.parent}/")


@keys.command("show")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=None, help=_DIR_HELP)
def show(directory: Path | None) -> None:
    """Print where the keys are and the cluster public key (never the secret)."""
    cluster = security.load_keys(directory)
    paths = security.key_paths(directory)
    mode = stat.S_IMODE(paths.secret.stat().st_mode)
    click.echo(f"keys directory:     {paths.secret.parent}")
    click.echo(f"cluster public key: {cluster.public.decode()}")
    click.echo(f"secret key file:    {paths.secret} (mode {mode:04o})")
