"""The systemd units, the sysusers.d file and their notes (`systemd/` at the repository's top, shipped
inside the wheel: flowedge/shipped.py), and `flowedge systemd install`, which puts them where systemd
looks; sd_notify.py is what a node and the HTTP server tell systemd while they run.

The units name `/opt/flowedge/.venv/bin/flowedge`; install rewrites that to the `flowedge` next to
the running interpreter, so a venv anywhere works. Installed (under `root`, default `/`):

    etc/systemd/system/flowedge-{head,stage,http}.service
    usr/lib/sysusers.d/flowedge.conf            (then `systemd-sysusers` creates the flowedge user)
    usr/share/doc/flowedge/systemd.md           (the units' Documentation=)
"""
from __future__ import annotations

import sys
from pathlib import Path

from flowedge.shipped import shipped_dir

HERE = shipped_dir("systemd")
UNITS = ("flowedge-head.service", "flowedge-stage.service", "flowedge-http.service")
SYSUSERS = HERE / "flowedge.sysusers.conf"
NOTES = HERE / "systemd.md"
SHIPPED_EXEC = "/opt/flowedge/.venv/bin/flowedge"


def install(root: Path | str = "/", flowedge_bin: Path | str | None = None) -> list[Path]:
    """Write the units (ExecStart pointing at `flowedge_bin`, default the one beside this Python), the
    sysusers.d file and the notes under `root`; returns the paths written."""
    root = Path(root)
    exe = str(flowedge_bin or Path(sys.executable).with_name("flowedge"))
    targets = [(root / "etc/systemd/system" / unit, (HERE / unit).read_text().replace(SHIPPED_EXEC, exe))
               for unit in UNITS]
    targets += [(root / "usr/lib/sysusers.d/flowedge.conf", SYSUSERS.read_text()),
                (root / "usr/share/doc/flowedge/systemd.md", NOTES.read_text())]
    for path, text in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [path for path, _ in targets]
