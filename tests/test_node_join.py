"""`flowedge serve` + `flowedge join` as separate processes with separate homes: the shard is fetched
through the head, checked, cached; a stage that dies mid-request and never comes back fails only that
request, once the recovery deadline has passed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from cluster_helpers import free_port_pair, logs, spawn_join
from flowedge.client.sync_client import Client, RequestFailed, wait_ready
from flowedge.models.shard_refs import RefFile, resolve_file
from flowedge.models.shards import Manifest, file_sha256
from flowedge.models.split import split_model
from flowedge.generate import GenerateRequest, run_generate
from flowedge.transport import security

PROMPT = "abc def ghi jkl"


def _serve(cfg_path, env, log_path) -> subprocess.Popen:
    logf = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "flowedge", "-v", "serve", "--config", str(cfg_path)],
                            stdout=logf, stderr=subprocess.STDOUT, env=env)
    logf.close()
    return proc


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_join_fetches_a_verified_shard_caches_it_and_survives_a_dead_stage(tiny_pair, tmp_path):
    _, draft = tiny_pair
    base = tmp_path / "w4a16"   # a W4A16 checkpoint: the head's split references it, copying nothing
    split_model(tiny_pair[0], 1, base, quant="int4")
    head_home, stage_home = tmp_path / "head-home", tmp_path / "stage-home"
    security.init_keys(head_home / "keys")
    port = free_port_pair()
    addr = f"127.0.0.1:{port}"
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'role = "head"\nhead = "{addr}"\nmodel = "{base}"\ndraft = "{draft}"\nstages = 1\n'
                   f'threads = 1\nwire_dtype = "float32"\nstage_timeout_s = 3.0\nheartbeat_ms = 500\n'
                   f'recovery_s = 3.0\n')
    head_env = {**os.environ, "FLOWEDGE_HOME": str(head_home)}
    stage_env = {"FLOWEDGE_HOME": str(stage_home)}
    keys = ["--keys", str(head_home / "keys"), "--node-id", "edge-1", "--stage-timeout", "3"]
    head = _serve(cfg, head_env, tmp_path / "head.log")
    stages: list[subprocess.Popen] = []
    reference = run_generate(GenerateRequest(PROMPT, str(base), str(draft), "ar", 30))["token_ids"]
    try:
        stages.append(spawn_join(addr, *keys, log_path=tmp_path / "stage-a.log", env=stage_env))
        os.environ["FLOWEDGE_HOME"] = str(head_home)   # this process acts as a client of that cluster
        wait_ready(addr, 120, alive=lambda: head.poll() is None and stages[-1].poll() is None)

        # The fetched shard is byte-identical to the head's and sits in the stage's cache.
        split = next((head_home / "shards").iterdir())
        spec = Manifest.load(split).stages[0]
        cached = stage_home / "stage-cache" / spec.sha256 / spec.file
        served = resolve_file(split, spec.file)   # the head holds a reference into the checkpoint...
        assert isinstance(served, RefFile) and not (split / spec.file).exists()
        assert cached.is_file() and file_sha256(cached) == served.sha256() == spec.sha256
        assert cached.read_bytes() == b"".join(served.blocks())   # ...the stage an ordinary file
        assert "fetching shard" in (tmp_path / "stage-a.log").read_text()
        # The only stage is the last one: it also fetched the head file (final norm + lm_head).
        head_spec = Manifest.load(split).head
        assert file_sha256(cached.parent / head_spec.file) == head_spec.sha256
        assert isinstance(resolve_file(split, head_spec.file), RefFile)
        assert "fetching the lm_head file" in (tmp_path / "stage-a.log").read_text()
        with Client(addr, timeout_s=30) as c:
            assert c.generate(PROMPT, max_new_tokens=30)["token_ids"] == reference

        # A stage that stops answering mid-request: the request pauses, and with no node taking the slot
        # within recovery_s it fails with a clear error...
        stages[-1].send_signal(signal.SIGSTOP)
        with Client(addr, timeout_s=30) as c:
            with pytest.raises(RequestFailed, match="stage 1 .*edge-1"):
                c.generate(PROMPT, max_new_tokens=30)
        stages[-1].kill()
        # ... and a restarted stage re-joins from its cache (no second fetch) and the head serves again.
        stages.append(spawn_join(addr, *keys, log_path=tmp_path / "stage-b.log", env=stage_env))
        wait_ready(addr, 120, alive=lambda: head.poll() is None and stages[-1].poll() is None)
        text = (tmp_path / "stage-b.log").read_text()
        assert "found in the cache" in text and "fetching shard" not in text and "fetching the lm_head" not in text
        with Client(addr, timeout_s=30) as c:
            assert c.generate(PROMPT, max_new_tokens=30, strategy="flowspec")["token_ids"] == reference

        # A damaged cache repairs itself: a cached shard, then a cached head file, with bytes
        # flipped (same size) fail their checksum once, are deleted and fetched again; before, the stage
        # refused every assignment until someone deleted the cache by hand.
        for n, (victim, sha) in enumerate([(cached, spec.sha256), (cached.parent / head_spec.file, head_spec.sha256)]):
            stages[-1].kill()
            stages[-1].wait(20)
            _flip_a_byte(victim)
            log_path = tmp_path / f"stage-repair-{n}.log"
            stages.append(spawn_join(addr, *keys, log_path=log_path, env=stage_env))
            wait_ready(addr, 90, alive=lambda: head.poll() is None and stages[-1].poll() is None)
            text = log_path.read_text()
            assert "failed its checksum" in text and "fetching it again (1 of 2)" in text, text[-2000:]
            assert file_sha256(victim) == sha
        with Client(addr, timeout_s=30) as c:
            assert c.generate(PROMPT, max_new_tokens=30)["token_ids"] == reference
    except BaseException:
        print(logs(tmp_path))
        raise
    finally:
        os.environ.pop("FLOWEDGE_HOME", None)
        _stop(*stages, head)


def test_interrupted_fetch_leaves_no_cache_entry(tmp_path):
    """A shard fetch that fails half-way (bad chunk) raises and leaves the cache empty."""
    import hashlib

    from flowedge.node import shard_fetch
    from flowedge.errors import ChecksumError
    from flowedge.transport import protocol as proto

    data = os.urandom(3 * shard_fetch.CHUNK_BYTES + 123)
    sha = hashlib.sha256(data).hexdigest()
    manifest = ('{"format": 1, "model": "m", "num_layers": 1, "hidden_size": 4, "dtype": "float32", '
                '"tied": true, "head": {"file": "head.safetensors", "sha256": "' + "0" * 64 + '", "bytes": 1}, '
                '"stages": [{"index": 0, "layers": [0, 1], "file": "stage-0.safetensors", "sha256": "'
                + sha + f'", "bytes": {len(data)}' + '}]}')
    assign = proto.Assign(stage_index=1, layer_start=0, layer_end=1, shard_sha256=sha, shard_bytes=len(data),
                          next_addr="", model="m", side_files={"manifest.json": manifest, "config.json": "{}"})
    asked: list[proto.ShardRequest] = []

    def receive_ok(timeout):
        req = asked.pop()   # newest first: chunks arrive out of order
        return proto.ShardChunk.of(req.offset, data[req.offset:req.offset + req.length], len(data))

    out = shard_fetch.fetch(assign, tmp_path / "ok", asked.append, receive_ok)
    assert (out / "stage-0.safetensors").read_bytes() == data
    assert shard_fetch.cached_shas(tmp_path / "ok") == [sha]

    def receive_bad(timeout):
        req = asked.pop()
        chunk = proto.ShardChunk.of(req.offset, data[req.offset:req.offset + req.length], len(data))
        if req.offset:
            object.__setattr__(chunk, "data", b"\0" * len(chunk.data))   # corrupted on the way
        return chunk

    asked.clear()
    with pytest.raises(ChecksumError):
        shard_fetch.fetch(assign, tmp_path / "bad", asked.append, receive_bad)
    assert shard_fetch.cached_shas(tmp_path / "bad") == []
    assert [p.name for p in (tmp_path / "bad" / "stage-cache").iterdir()] == []


def test_up_detach_status_prompt_down_from_the_command_line(tiny_pair, tmp_path):
    from cluster_helpers import flowedge_cli

    base, draft = tiny_pair
    port, data = str(free_port_pair()), free_port_pair()
    env = {"FLOWEDGE_HOME": str(tmp_path / "home")}
    up = flowedge_cli("up", "--nodes", "2", "--model", str(base), "--draft", str(draft), "--port", port,
                      "--threads", "1", "--detach", "--data-port", f"{data}-{data + 1}", env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert "cluster ready" in up.stderr
        pids = json.loads((tmp_path / "home" / "run" / f"up-{port}" / "cluster.json").read_text())["pids"]
        listening = {c.laddr for pid in pids for c in psutil.Process(pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", int(port)), ("127.0.0.1", int(port) + 1), ("127.0.0.1", data)}, \
            listening   # a loopback cluster: nothing on 0.0.0.0; the stage's data port pinned
        again = flowedge_cli("up", "--nodes", "2", "--model", str(base), "--port", port, "--detach", env=env)
        assert again.returncode == 1 and "already runs" in again.stderr
        status = flowedge_cli("status", "--head", f"127.0.0.1:{port}", env=env)
        assert status.returncode == 0 and "stage-1" in status.stdout and "ready" in status.stdout
        answer = flowedge_cli("prompt", "zzzz", "--head", f"127.0.0.1:{port}", "--max-new-tokens", "8", env=env)
        assert answer.returncode == 0 and "8 tokens" in answer.stderr
        assert "a supervisor starts a stage that dies again" in up.stderr
        _a_killed_stage_is_started_again_by_the_supervisor(tmp_path / "home" / "run" / f"up-{port}", port, env)
    finally:
        down = flowedge_cli("down", "--port", port, env=env)
    assert down.returncode == 0, down.stderr
    assert down.stdout.startswith(f"stopped the cluster at 127.0.0.1:{port}: 2 processes (head, stage-1)"), down.stdout
    gone = flowedge_cli("status", "--head", f"127.0.0.1:{port}", env=env)
    assert gone.returncode == 1 and gone.stderr.startswith("error: cannot reach a flowedge head")


def test_a_damaged_cache_file_is_deleted_for_a_fresh_fetch_a_bounded_number_of_times(tmp_path):
    import hashlib

    from flowedge.node import shard_fetch
    from flowedge.errors import ChecksumError
    from flowedge.transport import protocol as proto

    data, head = os.urandom(1000), os.urandom(300)
    sha, head_sha = hashlib.sha256(data).hexdigest(), hashlib.sha256(head).hexdigest()
    manifest = json.dumps({"format": 1, "model": "m", "num_layers": 1, "hidden_size": 4, "dtype": "float32",
                           "tied": True, "head": {"file": "head.safetensors", "sha256": head_sha, "bytes": 300},
                           "stages": [{"index": 0, "layers": [0, 1], "file": "stage-0.safetensors", "sha256": sha,
                                       "bytes": 1000}]})
    assign = proto.Assign(stage_index=1, layer_start=0, layer_end=1, shard_sha256=sha, shard_bytes=1000, next_addr="",
                          model="m", side_files={"manifest.json": manifest, "config.json": "{}"},
                          head_sha256=head_sha, head_bytes=300)
    home = tmp_path / "home"

    def fetched() -> Path:
        asked: list[proto.ShardRequest] = []
        entry = shard_fetch.fetch(assign, home, asked.append, lambda timeout: proto.ShardChunk.of(
            asked[-1].offset, data[asked[-1].offset:asked[-1].offset + asked[-1].length], len(data)))
        if not (entry / "head.safetensors").is_file():
            (entry / "head.safetensors").write_bytes(head)
        return entry

    repair = shard_fetch.CacheRepair(home, limit=2)
    entry = fetched()
    assert shard_fetch.damaged_files(entry, assign) == []
    _flip_a_byte(entry / "head.safetensors")                 # the head file alone: only it goes
    repair.repair(entry, assign, ChecksumError("head.safetensors is corrupt"))
    assert not (entry / "head.safetensors").exists() and (entry / "stage-0.safetensors").is_file()
    for _ in range(2):                                        # the shard: the whole entry goes, twice
        entry = fetched()
        _flip_a_byte(entry / "stage-0.safetensors")
        repair.repair(entry, assign, ChecksumError("stage-0.safetensors is corrupt"))
        assert not entry.exists() and shard_fetch.cached_dir(home, sha) is None
    entry = fetched()
    _flip_a_byte(entry / "stage-0.safetensors")
    with pytest.raises(ChecksumError, match="fetched again 2 times and still damaged: check this device's storage"):
        repair.repair(entry, assign, ChecksumError("stage-0.safetensors is corrupt"))
    assert entry.is_dir()                                     # the third time the error stands
    with pytest.raises(ChecksumError, match="the head's copy is damaged"):   # same host: not the stage's files
        repair.repair(tmp_path / "head-split", assign, ChecksumError("stage-0.safetensors is corrupt"))


def test_a_cached_shard_reused_for_another_model_takes_its_side_files_and_drops_the_old_head_file(tmp_path, caplog):
    """Two models may share a stage file's bytes (a model with another head or config): the cache entry,
    keyed by those bytes, is reused, but not with the first model's config, manifest or head file."""
    import hashlib

    from flowedge.node import shard_fetch
    from flowedge.transport import protocol as proto

    data = os.urandom(1000)
    sha = hashlib.sha256(data).hexdigest()

    def assign_for(model: str, config: str) -> proto.Assign:
        manifest = json.dumps({"format": 2, "model": "m", "num_layers": 1, "hidden_size": 4, "dtype": "float32",
                               "tied": True, "source_sha256": model,
                               "head": {"file": "head.safetensors", "sha256": "0" * 64, "bytes": 300},
                               "stages": [{"index": 0, "layers": [0, 1], "file": "stage-0.safetensors",
                                           "sha256": sha, "bytes": 1000}]})
        return proto.Assign(stage_index=1, layer_start=0, layer_end=1, shard_sha256=sha, shard_bytes=1000,
                            next_addr="", model="m", side_files={"manifest.json": manifest, "config.json": config},
                            model_sha256=model)

    first, second = assign_for("a" * 64, '{"rope_theta": 1}'), assign_for("b" * 64, '{"rope_theta": 2}')
    asked: list[proto.ShardRequest] = []
    entry = shard_fetch.fetch(first, tmp_path, asked.append, lambda timeout: proto.ShardChunk.of(
        asked[-1].offset, data[asked[-1].offset:asked[-1].offset + asked[-1].length], len(data)))
    (entry / "head.safetensors").write_bytes(os.urandom(300))   # the first model's lm_head
    shard_fetch.refresh_side_files(entry, first)                  # its own model: nothing to do
    assert (entry / "head.safetensors").is_file()
    with caplog.at_level("WARNING", logger="flowedge.node.shard_fetch"):
        shard_fetch.refresh_side_files(shard_fetch.cached_dir(tmp_path, sha), second)
    assert "cut from model sha256 aaaaaaaaaaaa" in caplog.text
    assert Manifest.load(entry).source_sha256 == "b" * 64 and (entry / "config.json").read_text() == '{"rope_theta": 2}'
    assert not (entry / "head.safetensors").exists() and (entry / "stage-0.safetensors").read_bytes() == data
def _a_killed_stage_is_started_again_by_the_supervisor(run_dir: Path, port: str, env: dict) -> None:
    from cluster_helpers import flowedge_cli, flowedge_home, wait_for_text

    state = json.loads((run_dir / "cluster.json").read_text())
    os.kill(state["pids"][1], signal.SIGKILL)
    supervisor_log = run_dir / "supervisor.log"
    assert wait_for_text(supervisor_log, "stage-1 restarted (pid", 30), supervisor_log.read_text()
    assert "stage-1 exited; restarting it in 1 s" in (run_dir / "supervisor.log").read_text()
    new = json.loads((run_dir / "cluster.json").read_text())["pids"][1]
    assert new != state["pids"][1] and psutil.pid_exists(new)
    with flowedge_home(Path(env["FLOWEDGE_HOME"])):   # its keys
        wait_ready(f"127.0.0.1:{port}", 120)
    answer = flowedge_cli("prompt", "zzzz", "--head", f"127.0.0.1:{port}", "--max-new-tokens", "8", "--timeout",
                          "120", env=env)
    assert answer.returncode == 0 and "8 tokens" in answer.stderr, answer.stderr
