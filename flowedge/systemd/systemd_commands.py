"""`flowedge systemd install` (wired into the CLI by flowedge/cli.py)."""
from __future__ import annotations

import click

from flowedge import systemd


@click.group("systemd")
def systemd_group() -> None:
    """The systemd units shipped in the package (`flowedge systemd install --help`; notes: systemd.md beside
    the units, in the repository's systemd/ folder)."""


@systemd_group.command("install")
@click.option("--root", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Install under this directory instead of / (for packaging).")
def systemd_install(root) -> None:
    """Install the units, the sysusers.d file and their notes (ExecStart: this install's flowedge)."""
    for path in systemd.install(root):
        click.echo(f"wrote {path}")
    click.echo("next: systemd-sysusers && systemctl daemon-reload (see /usr/share/doc/flowedge/systemd.md)")
