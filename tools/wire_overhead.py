"""Measure what a request costs on the wire: a local cluster of real processes, one prompt, then every
node's byte counters (ZMTP framing + CurveZMQ + msgpack headers vs tensor payload) and per-stage step
times from `flowedge status`.

    python tools/wire_overhead.py --nodes 5 --prompt "Write a quicksort in Python." --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import logging
import time

from flowedge.client.sync_client import Client, wait_ready
from flowedge.launch import local_cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--strategy", default="flowspec")
    ap.add_argument("--prompt", default="Write a Python function that merges two sorted lists.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--wire-dtype", default="float16")
    ap.add_argument("--insecure", action="store_true", help="measure without CurveZMQ")
    ap.add_argument("--port", type=int, default=5585)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = local_cluster.LocalClusterSpec(nodes=args.nodes, model=args.model, draft=args.draft, port=args.port,
                                          wire_dtype=args.wire_dtype, insecure=args.insecure,
                                          stage_timeout_s=120.0)
    cluster = local_cluster.start(spec)
    try:
        wait_ready(spec.addr, 1800, insecure=args.insecure, alive=cluster.alive)
        with Client(spec.addr, insecure=args.insecure, timeout_s=900) as client:
            res = client.generate(args.prompt, max_new_tokens=args.max_new_tokens, strategy=args.strategy)
            time.sleep(2.5)   # let every stage send a heartbeat carrying its final counters
            nodes = client.status()
    finally:
        cluster.stop()
    report = summarize(res, nodes)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{res['new_tokens']} tokens, {res['steps']} pipeline steps, {res.get('verifications', 0)} verifications, "
          f"{res['tokens_per_s']:.2f} tok/s (wall, head), wire {args.wire_dtype}"
          f"{'' if args.insecure else ' + CurveZMQ'}")
    print(f"{'message':<10} {'count':>7} {'payload B':>12} {'wire B':>12} {'overhead':>9}")
    for kind, row in report["by_type"].items():
        print(f"{kind:<10} {row['messages']:>7} {row['payload_bytes']:>12} {row['wire_bytes']:>12} "
              f"{row['overhead_pct']:>8.2f}%")
    t = report["total"]
    print(f"{'total':<10} {t['messages']:>7} {t['payload_bytes']:>12} {t['wire_bytes']:>12} {t['overhead_pct']:>8.2f}%")
    print(f"per verification step: {report['per_step_wire_bytes']:.0f} B on the wire, "
          f"{report['per_step_payload_bytes']:.0f} B payload")
    print("median step wall time per stage (ms): " + ", ".join(
        f"stage {k}: {v}" for k, v in report["stage_step_ms_median"].items()))


def summarize(res: dict, nodes: list[dict]) -> dict:
    by_type: dict[str, dict] = {}
    for node in nodes:
        for kind, row in (node.get("wire") or {}).items():
            acc = by_type.setdefault(kind, {"messages": 0, "payload_bytes": 0, "wire_bytes": 0})
            for k in acc:
                acc[k] += row[k]
    for row in by_type.values():
        row["overhead_pct"] = round(100 * (row["wire_bytes"] - row["payload_bytes"]) / max(1, row["payload_bytes"]), 3)
    total = {k: sum(r[k] for r in by_type.values()) for k in ("messages", "payload_bytes", "wire_bytes")}
    framing = total["wire_bytes"] - total["payload_bytes"]
    total["overhead_pct"] = round(100 * framing / max(1, total["payload_bytes"]), 3)
    steps = max(1, res.get("steps") or 1)
    return {"result": {k: v for k, v in res.items() if k not in ("token_ids", "text")}, "by_type": by_type,
            "total": total, "per_step_wire_bytes": total["wire_bytes"] / steps,
            "per_step_payload_bytes": total["payload_bytes"] / steps,
            "stage_step_ms_median": {n["stage"]: n.get("step_ms_median") for n in nodes[1:]}}


if __name__ == "__main__":
    main()
