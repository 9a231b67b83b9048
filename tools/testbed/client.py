"""The user on device 0: runs inside its namespace (outside its cgroup), prompts one side and prints one JSON
object per prompt on stdout.

    python -m tools.testbed.client flowedge-ready HEAD TIMEOUT_S
    python -m tools.testbed.client flowedge HEAD CASES.json MAX_NEW STRATEGY
    python -m tools.testbed.client llama-ready URL TIMEOUT_S
    python -m tools.testbed.client llama URL CASES.json MAX_NEW

CASES.json: a list of {"prompt_id", "kind", "text", "ids"}; flowedge gets the text (its head applies the chat
template), llama-server the same template's token ids. The decode rate on both sides leaves out prefill and
the first token: flowedge's is (tokens - 1) / (wall - first token), llama-server's its own
`timings.predicted_per_second`.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

WARM_UP = "Say hi."


def flowedge_ready(head: str, timeout_s: float) -> None:
    from flowedge.client.sync_client import wait_ready

    wait_ready(head, timeout_s, insecure=True)


def flowedge_prompts(head: str, cases: list[dict], max_new: int, strategy: str) -> None:
    from flowedge.client.sync_client import Client

    with Client(head, insecure=True, timeout_s=600.0) as client:
        client.generate(WARM_UP, max_new_tokens=8, temperature=0.0, strategy=strategy)   # untimed
        for case in cases:
            ans = client.generate(case["text"], max_new_tokens=max_new, temperature=0.0, strategy=strategy)
            n, first = len(ans.token_ids), ans.first_token_s
            decode_s = ans.client_wall_s - first if first is not None else None
            rate = (n - 1) / decode_s if decode_s and n > 1 else None
            emit({"prompt_id": case["prompt_id"], "kind": case["kind"], "new_tokens": n,
                  "token_ids": list(ans.token_ids), "decode_tokens_per_s": rate,
                  "wall_tokens_per_s": ans.wall_tokens_per_s, "first_token_s": first,
                  "strategy": ans.stats.strategy, "mean_accept_len": ans.stats.figures.get("mean_accept_len")})


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def healthy_within(url: str, timeout_s: float, gone: Callable[[], bool] = lambda: False) -> bool:
    """Poll a llama-server's /health until it answers 200 (True), or `timeout_s` passes or `gone()` says
    the server has exited (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not gone():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    return False


def llama_ready(url: str, timeout_s: float) -> None:
    if not healthy_within(url, timeout_s):
        raise SystemExit(f"llama-server at {url} was not ready within {timeout_s:.0f} s")


def llama_prompts(url: str, cases: list[dict], max_new: int) -> None:
    def complete(ids: list[int], n: int) -> dict:
        return _post(f"{url}/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                           "cache_prompt": False, "return_tokens": True}, 1800.0)

    complete(cases[0]["ids"][:16], 8)   # untimed warm-up
    for case in cases:
        res = complete(case["ids"], max_new)
        t = res.get("timings", {})
        emit({"prompt_id": case["prompt_id"], "kind": case["kind"], "new_tokens": t.get("predicted_n"),
              "token_ids": res.get("tokens", []), "decode_tokens_per_s": t.get("predicted_per_second"),
              "first_token_s": (t.get("prompt_ms") or 0) / 1e3,
              "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")})


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: list[str]) -> int:
    cmd, target, *rest = argv
    if cmd == "flowedge-ready":
        flowedge_ready(target, float(rest[0]))
    elif cmd == "flowedge":
        flowedge_prompts(target, json.loads(Path(rest[0]).read_text()), int(rest[1]), rest[2])
    elif cmd == "llama-ready":
        llama_ready(target, float(rest[0]))
    elif cmd == "llama":
        llama_prompts(target, json.loads(Path(rest[0]).read_text()), int(rest[1]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
