"""What the operator and the asyncio client see of a standby head, on real processes (the failover drill's
cluster: a head, a standby with failover_s = 1 and two stages on the tiny pair, CurveZMQ on):

- `flowedge status --json` at the head shows its fencing term and the standby following it (its address,
  how far its log is behind); at the standby's own address, the standby's role and the head it follows;
  after a kill -9 of the head, the new head's term is one more;
- the asyncio client (the HTTP front's) notices the lost head by its closed connection, as the sync client
  does, not after `head_timeout_s` (5 s) of silence: its answer resumes at the new head well within 4 s
  of the kill and is token-identical."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from test_node_failover import MAX_NEW, hf, nodes  # noqa: F401 - `nodes` is the cluster fixture

ASYNC_FAILOVER_LIMIT_S = 4.0   # head_timeout_s is 5 s: a client that waits for it cannot make this


def status_json(addr: str) -> list[dict]:
    """`flowedge status --json` as an operator runs it, in its own process."""
    out = subprocess.run([sys.executable, "-m", "flowedge", "status", "--head", addr, "--json"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _standby_caught_up(addr: str) -> list[dict] | None:
    nodes_ = status_json(addr)
    rows = nodes_[0].get("standbys") or []
    return nodes_ if rows and rows[0].get("log_applied_tokens") and rows[0].get("log_behind_tokens") == 0 else None


def test_status_shows_the_term_and_the_standby_and_the_new_head_s_term_after_a_kill(nodes):  # noqa: F811
    head = status_json(nodes.a)[0]
    assert head["term"] == 1 and [r["node_id"] for r in head["standbys"]] == ["standby"], head
    assert head["standbys"][0]["address"] == nodes.b, head
    asker = hf.Asker(f"{nodes.a},{nodes.b}", hf.prompts(1)[0], 24, "ar-pp")
    asker.run()
    assert asker.done, asker
    got: list = []
    assert hf.wait_for(lambda: got.append(_standby_caught_up(nodes.a)) or got[-1], 10, 0.3), got[-1:]
    row = got[-1][0]["standbys"][0]
    assert row["log_sent_tokens"] >= 24 and row["log_applied_tokens"] == row["log_sent_tokens"], row
    assert row["last_seen_s"] < 1.0 and row["state_age_s"] is not None and row["state_age_s"] < 1.0, row
    text = subprocess.run([sys.executable, "-m", "flowedge", "status", "--head", nodes.a], capture_output=True,
                          text=True, timeout=60).stdout
    assert "fencing term 1; standby heads: 1" in text and f"standby standby at {nodes.b}" in text, text
    [own] = status_json(nodes.b)   # asked at the standby itself
    assert own == {"node_id": "standby", "role": "standby", "address": nodes.b, "follows": nodes.a, "term": 1,
                   "ready": False}, own
    nodes.procs["head"].send_signal(signal.SIGKILL)
    nodes.procs["head"].wait()
    assert hf.wait_for(lambda: hf.serving(nodes.b), 60, 0.1), nodes.logs()
    new = status_json(nodes.b)[0]
    assert new["role"] == "head" and new["node_id"] == "standby" and new["term"] == 2, new
    assert new["standbys"] == [], new


@pytest.mark.parametrize("use_async", [True, False], ids=["asyncio", "sync"])
def test_the_asyncio_client_follows_a_killed_head_as_fast_as_the_sync_one(nodes, tiny_pair, use_async):  # noqa: F811
    prompt = hf.prompts(2)[1]
    [ref] = hf.references(tiny_pair[0], [prompt], MAX_NEW)
    asker = hf.Asker(f"{nodes.a},{nodes.b}", prompt, MAX_NEW, "ar-pp", use_async=use_async)   # head_timeout_s: 5 s
    t = threading.Thread(target=asker.run, daemon=True)
    t.start()
    assert asker.first.wait(120), nodes.logs()
    killed_at = time.monotonic()
    nodes.procs["head"].send_signal(signal.SIGKILL)
    t.join(120)
    assert asker.done and asker.tokens == ref, (asker.error, len(asker.tokens), nodes.logs())
    before = [s for s in asker.times if s <= killed_at]
    after = [s - killed_at for s in asker.times if s > killed_at + 0.05]
    assert before and after, (asker.times, killed_at)   # the kill landed mid-answer
    print(f"{'asyncio' if use_async else 'sync'} client: first token from the new head {after[0]:.2f} s after the kill")
    assert after[0] < ASYNC_FAILOVER_LIMIT_S, (after[0], nodes.log_text("standby")[-3000:])
