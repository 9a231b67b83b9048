"""Several requests at once on real processes (3 nodes, tiny models, W4A16 stages, fp32 wire): each
answer token-identical to plain greedy decoding (flowspec and ar-pp), stages batching them and node 0
sharing draft forwards, within a per-stage KV budget that holds two of them at a time (a request that can
never fit is refused at once); a cancelled request's KV freed on every stage (the stages report the KV
tokens they hold in their heartbeats)."""
from __future__ import annotations

import threading
import time

import pytest

from cluster_helpers import flowedge_home, free_port_pair, start_cluster
from flowedge.client.sync_client import Client, RequestFailed
from flowedge.launch.local_cluster import LocalClusterSpec
from flowedge.generate import GenerateRequest, run_generate

PROMPTS = ["abc def ghi jkl", "The quick brown fox", "zzzz", "def fib(n):"]
MAX_NEW = 32
KV_BUDGET = 500   # tokens per stage: each request reserves its chat prompt (22-37) + 32 + a 144-entry tree: two fit


@pytest.fixture(scope="module")
def cluster(tiny_pair, tmp_path_factory):
    base, draft = tiny_pair
    with flowedge_home(tmp_path_factory.mktemp("home")):
        spec = LocalClusterSpec(nodes=3, model=str(base), draft=str(draft), port=free_port_pair(), threads=1,
                                wire_dtype="float32", device="orin-nano-8gb", max_concurrent=3,
                                kv_budget_tokens=KV_BUDGET)
        c = start_cluster(spec)
        yield c
        c.stop()


def _stage_kv(addr: str) -> list[tuple[int, int]]:
    with Client(addr) as client:
        nodes = [n for n in client.status() if n.get("role") == "stage"]
    return [(int(n.get("kv_tokens", -1)), int(n.get("requests", -1))) for n in nodes]


def _ask_together(addr: str, strategy: str) -> dict[str, list[int]]:
    answers: dict[str, list[int]] = {}

    def ask(prompt: str) -> None:
        with Client(addr) as client:
            answers[prompt] = client.generate(prompt, max_new_tokens=MAX_NEW, strategy=strategy)["token_ids"]

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return answers


def test_concurrent_answers_match_greedy_and_cancel_frees_stage_kv(cluster, tiny_pair):
    base, draft = tiny_pair
    refs = {p: run_generate(GenerateRequest(p, str(base), str(draft), "ar", MAX_NEW))["token_ids"] for p in PROMPTS}
    for strategy in ("flowspec", "ar-pp"):   # ar-pp: every stage step batches the requests' single rows
        assert _ask_together(cluster.spec.addr, strategy) == refs, strategy
    assert "waits for KV" in (cluster.run_dir / "head.log").read_text()   # the third waited for the budget
    with Client(cluster.spec.addr) as client:   # node 0 shared draft forwards between the requests
        drafts = next(n for n in client.status() if n.get("role") == "head")["draft_batching"]
    assert drafts["calls"] > drafts["forwards"] > 0
    with Client(cluster.spec.addr) as client:   # 400 new tokens + a tree > 500: never fits, one clear error
        with pytest.raises(RequestFailed, match="KV tokens on every stage.*stage 1 can hold 500"):
            client.generate(PROMPTS[0], max_new_tokens=400, strategy="flowspec")
    # a client that leaves mid-answer: its request is cancelled and every stage drops its KV
    with Client(cluster.spec.addr) as client:
        stream = client.stream(PROMPTS[0], max_new_tokens=200, strategy="ar-pp")
        next(stream)
        stream.close()   # leaving the loop early sends Cancel
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(kv for kv, _ in _stage_kv(cluster.spec.addr)):
        time.sleep(0.5)
    assert _stage_kv(cluster.spec.addr) == [(0, 0), (0, 0)]
