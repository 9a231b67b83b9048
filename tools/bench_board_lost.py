"""A board lost for good, measured: a local cluster (`flowedge up --nodes N`'s processes), answers in
flight and queued, one stage killed -9 and never restarted; the head re-plans onto the stages left
(node/shrink.py) and every answer must equal the undisturbed one (T=0).

Figures: the undisturbed answer's wall time; the kill -> the head's loss event; the loss -> the re-plan
decision (recovery_s - 2 s); the re-plan's own time (decision -> every survivor ready with its new layers,
the head's `last_replan_s`); the kill -> the last answer; the answers identical to the undisturbed one.

    PYTHONPATH=$PWD python tools/bench_board_lost.py --tiny --out docs/bench/board-lost-for-good/tiny.json
    PYTHONPATH=$PWD python tools/bench_board_lost.py --out docs/bench/board-lost-for-good/real.json
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from flowedge.client.sync_client import Client, wait_ready
from flowedge.errors import FlowedgeError
from flowedge.launch import local_cluster

log = logging.getLogger("bench_board_lost")
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def ask(addr: str, max_new: int, strategy: str, out: dict, first: threading.Event) -> None:
    """One client's whole answer into `out` (token ids, replays, when it ended), or its error."""
    try:
        with Client(addr, timeout_s=900) as c:
            for _ in c.stream(PROMPT, max_new_tokens=max_new, strategy=strategy):
                first.set()
            out.update(tokens=list(c.last_result.token_ids), replays=c.last_result.stats.replays)
    except FlowedgeError as err:
        out["error"] = str(err)
    finally:
        out["ended"] = time.monotonic()
        first.set()


def head_row(addr: str) -> dict:
    with Client(addr, timeout_s=30) as c:
        return c.status()[0]


def undisturbed(addr: str, max_new: int, strategy: str) -> tuple[list[int], float]:
    t0 = time.monotonic()
    with Client(addr, timeout_s=900) as c:
        answer = c.generate(PROMPT, max_new_tokens=max_new, strategy=strategy)
    return list(answer.token_ids), time.monotonic() - t0


def drill(cluster: local_cluster.LocalCluster, args) -> dict:
    addr = cluster.spec.addr
    ref, ref_s = undisturbed(addr, args.max_new_tokens, args.strategy)
    outs = [dict() for _ in range(args.clients)]
    first = threading.Event()
    threads = [threading.Thread(target=ask, args=(addr, args.max_new_tokens, args.strategy, o, first), daemon=True)
               for o in outs]
    for t in threads:
        t.start()
    first.wait(600)
    killed_unix, killed = time.time(), time.monotonic()
    cluster.procs[args.stage].send_signal(signal.SIGKILL)   # never restarted
    for t in threads:
        t.join(1800)
    head = head_row(addr)
    events = {e["kind"]: e["at_unix"] for e in head["membership"]["events"]}
    return {
        "model": args.model, "nodes": args.nodes, "killed_stage": args.stage, "clients": args.clients,
        "max_new_tokens": args.max_new_tokens, "strategy": args.strategy, "recovery_s": args.recovery,
        "undisturbed_s": round(ref_s, 2), "undisturbed_tokens": len(ref),
        "lost_after_kill_s": _since(killed_unix, events.get("lost")),
        "decision_after_loss_s": _since(events.get("lost"), events.get("replanning")),
        "replan_s": head["membership"]["last_replan_s"],
        "last_answer_after_kill_s": round(max(o["ended"] for o in outs) - killed, 2),
        "answered": sum("tokens" in o for o in outs), "errors": [o["error"] for o in outs if "error" in o],
        "identical": sum(o.get("tokens") == ref for o in outs), "replays": sum(o.get("replays", 0) for o in outs),
        "events": head["membership"]["events"],
        "stages_after": [r.get("layers") for r in _stage_rows(addr)],
    }


def _since(a: float | None, b: float | None) -> float | None:
    return round(b - a, 3) if a is not None and b is not None else None


def _stage_rows(addr: str) -> list[dict]:
    with Client(addr, timeout_s=30) as c:
        return [r for r in c.status() if r.get("role") == "stage"]


def tiny_models() -> tuple[str, str]:
    from flowedge.models.tiny import make_tiny_pair

    base, draft = make_tiny_pair(Path(tempfile.gettempdir()) / "flowedge-bench-tiny-pair")
    return str(base), str(draft)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny generated pair (fp32 wire) instead of --model")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--stage", type=int, default=2, help="the stage killed (never restarted)")
    ap.add_argument("--clients", type=int, default=6, help="answers at once (max_concurrent 4: the rest queue)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--strategy", default="ar-pp")
    ap.add_argument("--recovery", type=float, default=30.0)
    ap.add_argument("--stage-timeout", type=float, default=10.0,
                    help="a busy 2-core box misses 2 s of heartbeats under the real pair; a kill is seen at once")
    ap.add_argument("--port", type=int, default=5595)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.tiny:
        args.model, args.draft = tiny_models()
    spec = local_cluster.LocalClusterSpec(nodes=args.nodes, model=args.model, draft=args.draft, port=args.port,
                                          threads=1, wire_dtype="float32", recovery_s=args.recovery,
                                          stage_timeout_s=args.stage_timeout)
    t0 = time.monotonic()
    cluster = local_cluster.start(spec)
    try:
        wait_ready(spec.addr, 1800, alive=cluster.alive)
        log.info("cluster ready in %.1f s", time.monotonic() - t0)
        figures = drill(cluster, args)
    finally:
        cluster.stop()
    figures["run_dir"] = str(cluster.run_dir)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    sys.exit(0 if figures["identical"] == args.clients else 1)


if __name__ == "__main__":
    main()
