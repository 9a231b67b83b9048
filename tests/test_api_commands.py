"""`flowedge http`'s flags: a configuration mistake exits with EX_CONFIG (78), the status the systemd unit
is told not to restart on, before any server starts."""
from __future__ import annotations

from click.testing import CliRunner

from flowedge.api.http_command import EX_CONFIG, http


def test_a_public_listen_address_without_an_api_key_exits_78() -> None:
    out = CliRunner().invoke(http, ["--listen", "0.0.0.0:0"], env={"FLOWEDGE_API_KEYS": ""})
    assert out.exit_code == EX_CONFIG == 78
    assert "refusing to listen on 0.0.0.0 without an API key" in out.output


def test_a_url_for_the_head_exits_78() -> None:
    out = CliRunner().invoke(http, ["--head", "http://127.0.0.1:7100"])
    assert out.exit_code == EX_CONFIG and "not a http:// URL" in out.output


def test_http_warns_at_start_when_its_head_is_unreachable() -> None:
    """Before: nothing was said until the first request got its 503."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from cluster_helpers import free_port_pair

    head = f"127.0.0.1:{free_port_pair()}"   # nothing listens there
    proc = subprocess.Popen([sys.executable, "-m", "flowedge", "http", "--listen", "127.0.0.1:0", "--head", head,
                             "--insecure"], stderr=subprocess.PIPE, text=True, env={**os.environ})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()   # a hung server blocks no one
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("unreachable" in line for line in lines):
            time.sleep(0.1)
        said = next((line for line in lines if "unreachable" in line), "")
        assert f"the head at {head} is unreachable: cannot reach a flowedge head" in said, "".join(lines)
        assert "requests get 503 until it answers" in said and " WARNING " in said
    finally:
        proc.terminate()
        proc.wait(10)
