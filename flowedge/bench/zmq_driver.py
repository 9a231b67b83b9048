"""`flowedge bench --driver zmq`: the same prompts and strategies on real processes over ZeroMQ
(a local cluster started for the run), timed by the wall clock — the check on the simulator."""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from flowedge.bench.runner import BenchConfig, record_run, write_table
from flowedge.core.sampling import SamplingParams
from flowedge.datasets import Prompt
from flowedge.node.node_config import DEFAULT_WIRE_DTYPE

log = logging.getLogger(__name__)


def run_bench_zmq(cfg: BenchConfig, prompts: list[Prompt], out: Path, say: Callable[[str], None] = lambda s: None,
                  *, wire_dtype: str = DEFAULT_WIRE_DTYPE, threads: int = 0, port: int = 5575) -> dict:
    from flowedge.launch import local_cluster
    from flowedge.client.sync_client import Client, wait_ready
    from flowedge.engine.local import generate_ar
    from flowedge.models.resolve import resolve_model
    from flowedge.models.stage import StageModel
    from flowedge.text.prompts import encode_prompt, load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    base_dir = resolve_model(cfg.model)
    tok = load_tokenizer(base_dir)
    sized = cfg.tree_size == "profile"   # the head sizes flowspec's tree only where tree_nodes is unset
    spec = local_cluster.LocalClusterSpec(nodes=cfg.nodes, model=cfg.model, draft=cfg.draft, port=port,
                                          threads=threads, wire_dtype=wire_dtype,
                                          tree_nodes=0 if sized else cfg.spec.tree_nodes,
                                          tree_size=cfg.tree_size, lm_head_at=cfg.spec.lm_head_at,
                                          predraft=cfg.spec.predraft, drafter=cfg.spec.predraft == "drafter")
    config = {k: v for k, v in asdict(cfg).items() if k != "spec"} | {
        "spec": asdict(cfg.spec), "driver": "zmq", "wire_dtype": wire_dtype,
        "threads_per_process": spec.per_process_threads(), "profile": "this machine (wall clock)"}
    results: dict = {"config": config, "runs": [], "summary": {}}
    # The reference is `ar` on the model the stages run: W4A16 (the cluster's default quant) for a
    # 16-bit checkpoint too, quantized the same way at load.
    reference = StageModel.load(base_dir, quant=spec.quant)
    cluster = local_cluster.start(spec)
    try:
        wait_ready(spec.addr, 1800, alive=cluster.alive, progress=lambda s: say(f"cluster: {s}"),
                   drafters=int(spec.drafter))
        total = len(prompts) * len(cfg.strategies)
        with Client(spec.addr, timeout_s=900) as client:
            for i, prompt in enumerate(prompts):
                params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i)
                ref = None
                if params.greedy:
                    ids = encode_prompt(tok, prompt.text, cfg.chat)
                    ref = generate_ar(base_dir, ids, cfg.max_new_tokens, params, model=reference).token_ids
                for j, name in enumerate(cfg.strategies):
                    res = client.generate(prompt.text, max_new_tokens=cfg.max_new_tokens,
                                          temperature=cfg.temperature, seed=params.seed, strategy=name)
                    run = _zmq_run(prompt, name, res.to_dict(), client.status(), ref)
                    say(f"[{i * len(cfg.strategies) + j + 1}/{total}] {prompt.dataset}/{prompt.prompt_id} {name}: "
                        f"{run['tokens_per_s']:.2f} tok/s (wall), accept {run['mean_accept_len']:.2f}"
                        + ("" if ref is None else f", {'matches' if run['matches_ar'] else 'MISMATCH vs'} ar"))
                    record_run(results, run, out)
    finally:
        cluster.stop()
    write_table(results, out)
    return results


def _zmq_run(prompt: Prompt, name: str, res: dict, nodes: list[dict], ref: list[int] | None) -> dict:
    """One run's record (results.json) from the head's result stats and the nodes' status after it."""
    run = {
        "prompt_id": prompt.prompt_id, "dataset": prompt.dataset, "strategy": name,
        "token_ids": res["token_ids"], "tokens_per_s": res["tokens_per_s"],
        "wall_tokens_per_s": res["wall_tokens_per_s"], "wall_s": res["wall_s"],
        "mean_accept_len": res.get("mean_accept_len", 1.0),
        "restarts": res.get("round_restarts", 0), "steps": res.get("steps"),
        "head_overhead_ms": res.get("head_overhead_ms_per_step"),
        "stage_step_ms_median": [n.get("step_ms_median") for n in nodes[1:] if n.get("role") == "stage"],
        "matches_ar": (res["token_ids"] == ref) if ref is not None else None,
    }
    if res.get("auto"):   # strategy auto: its choice and reason
        run["auto"] = res["auto"]
    if res.get("predraft"):   # pre-drafting: jobs, hits, grafted nodes (engine/predraft.py)
        run["predraft"] = res["predraft"]
    return run
