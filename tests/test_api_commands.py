"""`flowedge http`'s flags: a configuration mistake exits with EX_CONFIG (78), the status the systemd unit
is told not to restart on, before any server starts."""
from __future__ import annotations

from click.testing import CliRunner

from flowedge.api.commands import EX_CONFIG, http


def test_a_public_listen_address_without_an_api_key_exits_78() -> None:
    out = CliRunner().invoke(http, ["--listen", "0.0.0.0:0"], env={"FLOWEDGE_API_KEYS": ""})
    assert out.exit_code == EX_CONFIG == 78
    assert "refusing to listen on 0.0.0.0 without an API key" in out.output


def test_a_url_for_the_head_exits_78() -> None:
    out = CliRunner().invoke(http, ["--head", "http://127.0.0.1:7100"])
    assert out.exit_code == EX_CONFIG and "not a http:// URL" in out.output
