"""The command line on tiny models: it generates, and bad input gives one clear line and exit 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def flowedge(*args: str, home=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if home is not None:
        env["FLOWEDGE_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "flowedge", *args, "--threads", "1"] if args[0] == "generate"
                          else [sys.executable, "-m", "flowedge", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[-1]


def test_generate_tree_matches_ar_json(tiny_pair):
    base, draft = tiny_pair
    outs = {}
    for strategy in ("ar", "tree", "flowspec"):
        proc = flowedge("generate", "hello world", "--model", str(base), "--draft", str(draft),
                        "--strategy", strategy, "--max-new-tokens", "16", "--json", "--nodes", "3")
        assert proc.returncode == 0, proc.stderr
        outs[strategy] = json.loads(proc.stdout)
    assert outs["tree"]["token_ids"] == outs["ar"]["token_ids"] == outs["flowspec"]["token_ids"]
    for key in ("text", "token_ids", "new_tokens", "wall_s"):
        assert key in outs["ar"]
    for strategy in ("ar", "tree"):   # decode speed without prefill, what the llama.cpp A/B compares
        out = outs[strategy]
        assert out["prefill_s"] + out["decode_s"] == pytest.approx(out["wall_s"], abs=2e-4)
        assert out["decode_tokens_per_s"] == pytest.approx((out["new_tokens"] - 1) / out["decode_s"], rel=5e-2)
    assert outs["tree"]["mean_accept_len"] >= 1.0
    assert outs["flowspec"]["sim_tokens_per_s"] > 0


def test_unknown_model_name(tmp_path):
    line = one_error_line(flowedge("generate", "hi", "--model", "no-such-model", home=tmp_path))
    assert "no-such-model" in line and "qwen2.5-coder-1.5b" in line


def test_prompt_longer_than_context(tiny_pair):
    base, _ = tiny_pair
    line = one_error_line(flowedge("generate", "x" * 2100, "--model", str(base), "--no-chat",
                                   "--max-new-tokens", "8"))
    assert "context" in line


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5"),
                                        ("--top-k", "-3"), ("--max-new-tokens", "0")])
def test_invalid_sampling_values(tiny_pair, flag, value):
    base, _ = tiny_pair
    line = one_error_line(flowedge("generate", "hi", "--model", str(base), flag, value))
    assert flag.strip("-").split("-")[0] in line.replace("_", "-")


def test_unknown_strategy(tiny_pair):
    base, draft = tiny_pair
    line = one_error_line(flowedge("generate", "hi", "--model", str(base), "--draft", str(draft),
                                   "--strategy", "warp-drive"))
    assert "flowspec" in line


def test_corrupt_shard_is_refused(tiny_pair, tmp_path):
    base, _ = tiny_pair
    out = tmp_path / "shards"
    proc = flowedge("split", str(base), "--stages", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    stage = out / "stage-0.safetensors"
    data = bytearray(stage.read_bytes())
    data[-1] ^= 0xFF
    stage.write_bytes(bytes(data))
    line = one_error_line(flowedge("generate", "hi", "--model", str(out), "--max-new-tokens", "2"))
    assert "corrupt" in line and "stage-0" in line


def _timed(*args: str, home) -> tuple[subprocess.CompletedProcess, float]:
    import time

    t0 = time.monotonic()
    proc = flowedge(*args, home=home)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("args,says", [
    (("up", "--strategy", "nope", "--detach"), "strategy must be one of auto, flowspec"),
    (("up", "--model", "nosuch-model", "--detach"), "qwen2.5-coder-1.5b"),
    (("up", "--draft", "/nowhere/x.gguf", "--detach"), "draft '/nowhere/x.gguf' is not a known model"),
    (("prompt", "hi", "--head", "http://127.0.0.1:7100"), "HOST:PORT (e.g. 127.0.0.1:7100)"),
    (("status", "--head", "tcp:/127.0.0.1"), "is not HOST:PORT"),
    (("http", "--head", "http://127.0.0.1:7100"), "not a http:// URL"),
    (("http", "--listen", "https://0.0.0.0:8080"), "TLS proxy"),
    (("join", "https://10.0.0.1:5555", "--insecure"), "HOST:PORT"),
])
def test_start_up_and_address_mistakes_are_one_line_at_once(tmp_path, args, says):
    """Before: `up --strategy nope` was "ready" and every prompt failed; `up --model nosuch-model` took
    ~36 s to say "a cluster process exited"; an http:// head was a 32-line ZMQError traceback, or a
    server answering 500."""
    proc, seconds = _timed(*args, home=tmp_path)
    line = one_error_line(proc)
    assert says in line and seconds < 3.0 + 2.0, (line, seconds)   # + the interpreter's start on a busy CI


def test_an_unreachable_head_is_reported_within_3_s(tmp_path):
    proc, seconds = _timed("prompt", "hi", "--head", "127.0.0.1:9", "--insecure", home=tmp_path)
    assert "cannot reach a flowedge head at 127.0.0.1:9" in one_error_line(proc)
    assert seconds < 3.0 + 1.5, seconds   # before: 10.7 s


def test_a_busy_port_and_down_without_a_cluster_name_the_command_that_works(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(flowedge("up", "--port", str(port), "--detach", home=tmp_path))
    assert f"port {port} on 127.0.0.1 is taken" in line and "flowedge up --port PORT" in line
    assert "`flowedge up --detach` records one" in one_error_line(flowedge("down", home=tmp_path))


def test_down_finds_the_one_recorded_cluster_and_asks_when_there_are_several(tmp_path, monkeypatch):
    from flowedge.launch import local_cluster

    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    for port in (7100, 7200):
        (tmp_path / "run" / f"up-{port}").mkdir(parents=True)
        (tmp_path / "run" / f"up-{port}" / local_cluster.STATE_FILE).write_text(
            json.dumps({"addr": f"127.0.0.1:{port}", "pids": [], "insecure": True}))
    with pytest.raises(local_cluster.ConfigError, match="ports 7100, 7200: `flowedge down --port PORT`"):
        local_cluster.down(grace_s=0.1)
    assert "127.0.0.1:7100" in local_cluster.down(7100, grace_s=0.1)
    assert "127.0.0.1:7200" in local_cluster.down(grace_s=0.1)   # the only one left, found without --port


def test_a_node_that_dies_is_reported_with_its_own_error_line(tmp_path):
    from flowedge.launch.local_cluster import LocalCluster, LocalClusterSpec

    (tmp_path / "head.log").write_text("INFO loading\nerror: model shard broken: bad magic\n")
    (tmp_path / "stage-1.log").write_text("INFO ok\n")
    procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])]
    try:
        procs[0].wait(10)
        cluster = LocalCluster(LocalClusterSpec(nodes=2, model="qwen2.5-coder-1.5b"), tmp_path, procs)
        assert not cluster.alive() and cluster.failure() == "head: model shard broken: bad magic"
    finally:
        procs[1].kill()
        procs[1].wait()


def test_strategy_names_match_the_engine():
    from flowedge.core.config import STRATEGY_NAMES
    from flowedge.engine.strategies import STRATEGIES

    assert sorted(STRATEGY_NAMES) == sorted(STRATEGIES)


def test_down_reports_what_it_stopped_and_what_had_already_exited(tmp_path, monkeypatch):
    """Before: "stopped the cluster at ... (3 processes)" whatever was still running."""
    from flowedge.launch import local_cluster

    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(sleeper) for _ in range(3)]
    procs[1].kill()
    procs[1].wait()   # stage-1 died before `down`
    supervisor = subprocess.Popen(sleeper)
    run_dir = tmp_path / "run" / "up-7300"
    run_dir.mkdir(parents=True)
    (run_dir / local_cluster.STATE_FILE).write_text(json.dumps({
        "addr": "127.0.0.1:7300", "pids": [p.pid for p in procs], "names": ["head", "stage-1", "stage-2"],
        "insecure": True, "supervisor": supervisor.pid}))
    try:
        line = local_cluster.down(7300, grace_s=0.5)
        assert supervisor.wait(5) is not None   # stopped first: it would restart what is being stopped
        assert line.startswith("stopped the cluster at 127.0.0.1:7300: 2 processes (head, stage-2)"), line
        assert line.endswith("; stage-1 had already exited"), line
        assert all(p.wait(5) is not None for p in procs)
        assert not (run_dir / local_cluster.STATE_FILE).exists()
    finally:
        for p in [*procs, supervisor]:
            p.kill()
            p.wait()
