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
def init(directory: Path | None, force: bool) -> None:
    """Create the cluster key pair; then copy the directory to every node."""
    paths = security.init_keys(directory, force=force)
    public = security.load_keys(paths.secret.parent).public.decode()
    click.echo(f"created {paths.secret} (secret, mode 0600) and {paths.public}")
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
