"""`flowedge bench --driver zmq --concurrency 1,4`: the concurrency sweep on real processes, wall clock.

For each level a local cluster is started with `max_concurrent` = that level; every prompt is sent at
once, each by its own client. Reported as in the simulated sweep (bench/concurrency.py), except the time
between tokens: a client sees text pieces, not tokens, so here it is the time between streamed pieces.
"matches" compares each answer with the same prompt served at the first level (one at a time).
"Requests per draft call" comes from the head's status (its draft batcher's forwards and the calls they
held during the level's run), "requests per stage forward" from the stages' heartbeats (their batched
forwards and the requests those held, summed over the stages).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from flowedge.bench.concurrency import concurrency_table, percentile, plot_concurrency
from flowedge.bench.runner import BenchConfig
from flowedge.datasets import Prompt
from flowedge.node.node_config import DEFAULT_WIRE_DTYPE


def _ask(addr: str, prompt: str, cfg: BenchConfig, strategy: str, out: dict) -> None:
    from flowedge.client.sync_client import Client

    t0 = time.monotonic()
    stamps: list[float] = []
    with Client(addr, timeout_s=900) as client:
        for _ in client.stream(prompt, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                               seed=cfg.seed, strategy=strategy):
            stamps.append(time.monotonic() - t0)
        answer = client.last_result
        out.update(token_ids=list(answer.token_ids) if answer else [], stamps=stamps)


def run_concurrency_zmq(cfg: BenchConfig, prompts: list[Prompt], levels: tuple[int, ...], out: Path,
                        say: Callable[[str], None] = lambda s: None, *, wire_dtype: str = DEFAULT_WIRE_DTYPE,
                        threads: int = 0, port: int = 5585) -> dict:
    from flowedge.launch import local_cluster
    from flowedge.client.sync_client import wait_ready

    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"config": {k: v for k, v in asdict(cfg).items() if k != "spec"} | {
        "driver": "zmq", "wire_dtype": wire_dtype, "levels": list(levels), "profile": "this machine (wall clock)",
        "verify": "stages", "prompts": [p.prompt_id for p in prompts]}, "rows": []}
    alone: dict[tuple[str, int], list[int]] = {}
    for c in levels:
        spec = local_cluster.LocalClusterSpec(nodes=cfg.nodes, model=cfg.model, draft=cfg.draft, port=port,
                                              threads=threads, wire_dtype=wire_dtype, max_concurrent=c,
                                              predraft=cfg.spec.predraft, drafter=cfg.spec.predraft == "drafter")
        cluster = local_cluster.start(spec)
        try:
            wait_ready(spec.addr, 1800, alive=cluster.alive, drafters=int(spec.drafter))
            for name in cfg.strategies:
                answers: list[dict] = [{} for _ in prompts]
                before = _batch_counts(spec.addr)
                t0 = time.monotonic()
                workers = [threading.Thread(target=_ask, args=(spec.addr, p.text, cfg, name, answers[i]))
                           for i, p in enumerate(prompts)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                wall_s = time.monotonic() - t0
                row = _row(name, c, answers, wall_s, alone)
                time.sleep(2 * spec.heartbeat_ms / 1000)   # the stages' counts come with their heartbeats
                after = _batch_counts(spec.addr)
                row["mean_draft_batch"] = _per_forward(before["draft"], after["draft"])
                row["mean_batch"] = _per_forward(before["stage"], after["stage"])
                results["rows"].append(row)
                say(f"{name} x{c}: {row['tokens_per_s']:.2f} tok/s (wall), p50 {row['p50_tbt_ms']:.0f} ms, "
                    f"p99 {row['p99_tbt_ms']:.0f} ms between pieces")
                (out / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            cluster.stop()
    (out / "table.md").write_text(concurrency_table(results))
    plot_concurrency(results, out / "concurrency.png")
    return results


def _batch_counts(addr: str) -> dict[str, dict]:
    """From one status reading: node 0's packed draft forwards and the calls they held ("draft"), and the
    stages' batched forwards and the requests they held, summed over the stages ("stage")."""
    from flowedge.client.sync_client import Client

    with Client(addr) as client:
        nodes = client.status()
    head = next(n for n in nodes if n.get("role") == "head")
    stages = [n.get("batched") or {} for n in nodes if n.get("role") == "stage"]
    return {"draft": head.get("draft_batching") or {"forwards": 0, "calls": 0},
            "stage": {"forwards": sum(r.get("forwards", 0) for r in stages),
                      "calls": sum(r.get("requests", 0) for r in stages)}}


def _per_forward(before: dict, after: dict) -> float | None:
    """Calls (requests) per batched forward between two readings (None: no forward in between)."""
    forwards = after["forwards"] - before["forwards"]
    return (after["calls"] - before["calls"]) / forwards if forwards else None


def _row(name: str, c: int, answers: list[dict], wall_s: float, alone: dict) -> dict:
    tokens = sum(len(a["token_ids"]) for a in answers)
    gaps = [b - a for ans in answers for a, b in zip(ans["stamps"], ans["stamps"][1:])]
    for i, ans in enumerate(answers):
        alone.setdefault((name, i), ans["token_ids"])
    return {"strategy": name, "concurrency": c, "requests": len(answers), "tokens": tokens, "sim_time_s": wall_s,
            "tokens_per_s": tokens / wall_s, "p50_tbt_ms": 1000 * (percentile(gaps, 50) or 0.0),
            "p99_tbt_ms": 1000 * (percentile(gaps, 99) or 0.0),
            "mean_ttft_s": sum(a["stamps"][0] for a in answers if a["stamps"]) / len(answers),
            "mean_batch": None, "mean_draft_batch": None,
            "matches_ar": all(a["token_ids"] == alone[(name, i)] for i, a in enumerate(answers)),
            "token_ids": [a["token_ids"] for a in answers]}
