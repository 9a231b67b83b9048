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
