"""The head plans the split once the stages' Hellos (device, free memory) are in: re-split when it pays,
kept otherwise, never over a manual `layers`; end to end with two stages on different devices."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from safetensors.torch import load_file

from cluster_helpers import free_port_pair, logs, spawn_join
from flowedge.client.sync_client import Client, wait_ready
from flowedge.models.content_hash import memo_at, model_sha256
from flowedge.models.shards import Manifest, load_shard
from flowedge.models.tiny import make_tiny_model
from flowedge.node.node_config import NodeConfig
from flowedge.node.partition_plan import ensure_split, planned_counts, split_dir_for
from flowedge.plan.shapes import load_shape
from flowedge.generate import GenerateRequest, run_generate
from flowedge.transport import protocol as proto
from flowedge.transport import security

GB = 10**9


def _hello(device: str, free_gb: float = 6.0, node: str = "n") -> proto.Hello:
    return proto.Hello(node_id=node, role="stage", device=device, free_memory_bytes=int(free_gb * GB))


def test_planned_counts_follow_the_devices_and_respect_manual_layers(caplog):
    config = load_shape("llama-2-7b")
    cfg = NodeConfig(stages=2, quant="int4")
    same = [_hello("orin-nano-8gb"), _hello("orin-nano-8gb")]
    assert planned_counts(cfg, config, [16, 16], same) is None               # balanced already: keep
    mixed = [_hello("agx-orin-64gb", 30), _hello("orin-nano-8gb")]
    counts = planned_counts(cfg, config, [16, 16], mixed)
    assert counts is not None and sum(counts) == 32 and counts[0] > counts[1]
    assert planned_counts(cfg.with_(layers=[16, 16]), config, [16, 16], mixed) is None
    assert planned_counts(cfg, config, [16, 16], [_hello("my-laptop"), _hello("orin-nano-8gb")]) is None
    # the current split does not fit a stage's free memory: re-split even on equal devices
    short = [_hello("orin-nano-8gb", 6.0), _hello("orin-nano-8gb", 3.0)]
    counts = planned_counts(cfg, config, [16, 16], short)
    assert counts is not None and counts[1] < 16
    # a device the planner would leave out: every slot still serves (the daemon keeps `stages`), and the
    # log says which node to stop
    with caplog.at_level("WARNING", logger="flowedge.node.partition_plan"):
        counts = planned_counts(cfg.with_(stages=3), config, [11, 11, 10],
                                [_hello("agx-orin-64gb", 30), _hello("rpi5-8gb", node="pi"), _hello("orin-nano-8gb")])
    assert counts is not None and len(counts) == 3
    assert "stage 2 (rpi5-8gb, node pi) slows the pipeline" in caplog.text and "stages = 2" in caplog.text
    # nothing fits: logged, the current split is kept
    assert planned_counts(NodeConfig(stages=2, quant="none"), load_shape("llama-2-70b"), [40, 40], same) is None


def test_a_split_is_keyed_by_the_model_s_content_and_one_of_another_model_is_cut_again(tmp_path, caplog):
    """Two models in directories of one name get two split directories; a split found where another model's
    should be (a cache written by hand, an older flowedge) is never served: it is cut again, and logged."""
    home = tmp_path / "home"
    a = make_tiny_model(tmp_path / "a" / "base", seed=1, num_layers=2)
    b = make_tiny_model(tmp_path / "b" / "base", seed=2, num_layers=2)
    key_a, key_b = (model_sha256(m, memo_at(home)) for m in (a, b))
    assert key_a != key_b
    assert split_dir_for(home, a, key_a, [1, 1]) != split_dir_for(home, b, key_b, [1, 1])
    out = split_dir_for(home, a, key_a, [1, 1])
    assert ensure_split(a, [1, 1], out, "a", source_sha256=key_a).source_sha256 == key_a
    with caplog.at_level("WARNING", logger="flowedge.node.partition_plan"):
        manifest = ensure_split(b, [1, 1], out, "b", source_sha256=key_b)
    assert manifest.source_sha256 == key_b == Manifest.load(out).source_sha256
    assert f"was cut from model sha256 {key_a[:12]}" in caplog.text and "splitting again" in caplog.text
    assert torch.equal(load_shard(out, 0)["model.layers.0.mlp.down_proj.weight"],
                       load_file(str(b / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"])


def test_head_resplits_for_the_devices_that_joined(tiny_pair, tmp_path):
    base, draft = tiny_pair
    home = tmp_path / "home"
    security.init_keys(home / "keys")
    addr = f"127.0.0.1:{free_port_pair()}"
    cfg = tmp_path / "head.toml"
    cfg.write_text(f'role = "head"\nhead = "{addr}"\nmodel = "{base}"\ndraft = "{draft}"\nstages = 2\n'
                   f'threads = 1\nwire_dtype = "float32"\n')
    env = {**os.environ, "FLOWEDGE_HOME": str(home)}
    with open(tmp_path / "head.log", "ab") as logf:
        head = subprocess.Popen([sys.executable, "-m", "flowedge", "-v", "serve", "--config", str(cfg)],
                                stdout=logf, stderr=subprocess.STDOUT, env=env)
    keys = ["--keys", str(home / "keys"), "--same-host"]
    stages = [spawn_join(addr, *keys, "--stage", str(k), "--device", dev, "--node-id", f"s{k}",
                         log_path=tmp_path / f"stage-{k}.log", env={"FLOWEDGE_HOME": str(home)})
              for k, dev in ((1, "agx-orin-64gb"), (2, "rpi5-8gb"))]
    reference = run_generate(GenerateRequest("abc def", str(base), str(draft), "ar", 20))["token_ids"]
    try:
        os.environ["FLOWEDGE_HOME"] = str(home)
        nodes = wait_ready(addr, 120, alive=lambda: head.poll() is None)
        layers = {n["stage"]: n["layers"] for n in nodes if n.get("stage")}
        assert layers == {1: [0, 3], 2: [3, 4]}, (layers, logs(tmp_path))   # the AGX takes the extra layers
        assert "planned split" in (tmp_path / "head.log").read_text()
        with Client(addr, timeout_s=60) as c:
            for strategy in ("ar-pp", "flowspec"):
                assert c.generate("abc def", max_new_tokens=20, strategy=strategy)["token_ids"] == reference
    finally:
        os.environ.pop("FLOWEDGE_HOME", None)
        for p in (*stages, head):
            p.send_signal(signal.SIGTERM)
        for p in (*stages, head):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
