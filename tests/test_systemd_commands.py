"""`flowedge systemd install --root DIR`: the units, the sysusers.d file and their notes land under DIR."""
from __future__ import annotations

from click.testing import CliRunner

from flowedge.systemd.systemd_commands import systemd_group


def test_install_writes_every_unit_under_the_root(tmp_path) -> None:
    out = CliRunner().invoke(systemd_group, ["install", "--root", str(tmp_path)])
    assert out.exit_code == 0, out.output
    units = tmp_path / "etc" / "systemd" / "system"
    assert sorted(p.name for p in units.iterdir()) == ["flowedge-head.service", "flowedge-http.service",
                                                       "flowedge-stage.service"]
    assert (tmp_path / "usr" / "lib" / "sysusers.d" / "flowedge.conf").is_file()
    assert out.output.count("wrote ") == 5 and "systemd-sysusers" in out.output
