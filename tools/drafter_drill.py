"""Drafter drill on a local cluster: a head, stages and a drafter process (predraft = "drafter"); one
answer undisturbed, one with the drafter kill -9'ed at its first tokens, one with no drafter at all.
Every answer must equal plain greedy decoding (`generate --strategy ar`) and none may fail.

    python tools/drafter_drill.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --max-new 64

Prints one JSON object: per run, identical to greedy or not, wall tokens/s, the longest silence between
chunks, the answer's pre-drafting stats and the head's drafter-job counters.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from flowedge.client.sync_client import Client, wait_ready
from flowedge.launch import local_cluster
from flowedge.generate import GenerateRequest, run_generate

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def answer(addr: str, prompt: str, max_new: int, on_first=None) -> dict:
    gaps, last, t0 = [], time.monotonic(), time.monotonic()
    with Client(addr, timeout_s=1800) as c:
        for i, _ in enumerate(c.stream(prompt, max_new_tokens=max_new, strategy="flowspec")):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if i == 0 and on_first is not None:
                on_first()
        res = c.last_result
        jobs = c.status()[0].get("drafter_jobs")
    return {"token_ids": res["token_ids"], "wall_s": round(time.monotonic() - t0, 3),
            "tokens_per_s": res.get("tokens_per_s"), "longest_silence_s": round(max(gaps[1:], default=0.0), 3),
            "predraft": res.get("predraft"), "drafter_jobs": jobs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--port", type=int, default=5655)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args(argv)
    reference = run_generate(GenerateRequest(args.prompt, args.model, args.draft, "ar", args.max_new))["token_ids"]
    spec = local_cluster.LocalClusterSpec(nodes=args.nodes, model=args.model, draft=args.draft, port=args.port,
                                          threads=args.threads, predraft="drafter", drafter=True, strategy="flowspec")
    cluster = local_cluster.start(spec)
    runs: dict = {}
    try:
        wait_ready(spec.addr, 1800, alive=cluster.alive, why=cluster.failure, drafters=1)
        drafter = cluster.procs[-1]
        runs["undisturbed"] = answer(spec.addr, args.prompt, args.max_new)
        runs["drafter-killed"] = answer(spec.addr, args.prompt, args.max_new,
                                        on_first=lambda: os.kill(drafter.pid, signal.SIGKILL))
        drafter.wait(30)
        time.sleep(2 * spec.stage_timeout_s)   # dropped by the head: the next answer has no drafter
        runs["no-drafter"] = answer(spec.addr, args.prompt, args.max_new)
    finally:
        cluster.stop()
    for run in runs.values():
        run["identical_to_greedy"] = run.pop("token_ids") == reference
    print(json.dumps({"model": args.model, "draft": args.draft, "nodes": args.nodes, "max_new": args.max_new,
                      "runs": runs}, indent=1))
    return 0 if all(r["identical_to_greedy"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
