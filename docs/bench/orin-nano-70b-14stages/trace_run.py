"""Strategies on the planned 14 x Orin Nano 70B cluster (sim, oracle verification), with each lane's time by phase.

Run from the repository root: PYTHONPATH=$PWD python docs/bench/orin-nano-70b-14stages/trace_run.py --strategies ar-pp,pipedec,flowspec --tokens 64 --trace"""
import sys, time, json, argparse, logging
from dataclasses import replace
from flowedge.core.config import SpecConfig
from flowedge.core.sampling import SamplingParams
from flowedge.costs.pipeline import draft_quant_for
from flowedge.datasets import load_prompts
from flowedge.models.resolve import resolve_model
from flowedge.plan.planned_cluster import plan_cluster
from flowedge.plan.predict import cost_model, _stage_path
from flowedge.text.prompts import encode_prompt, load_tokenizer
from flowedge.sim.cluster import SimCluster
from flowedge.sim.run import Cluster

ap = argparse.ArgumentParser()
ap.add_argument("--strategies", default="pipedec")
ap.add_argument("--n", type=int, default=14)
ap.add_argument("--tokens", type=int, default=32)
ap.add_argument("--datasets", default="mt-bench")
ap.add_argument("--samples", type=int, default=1)
ap.add_argument("--spec", default="{}")
ap.add_argument("--model", default="llama-2-70b")
ap.add_argument("--trace", action="store_true")
ap.add_argument("--fp32-draft", action="store_true")
a = ap.parse_args()
if "-v" in sys.argv: logging.basicConfig(level=logging.INFO)
cl = plan_cluster(a.model, ["orin-nano-8gb"] * a.n, quant="int4")
print("bottleneck ms", 1e3 * cl.plan.bottleneck_s, "latency ms", 1e3 * cl.plan.latency_s, "ranges", cl.plan.ranges)
spec = SpecConfig().with_(**json.loads(a.spec))
base, draft = resolve_model("qwen2.5-coder-1.5b"), resolve_model("qwen2.5-coder-0.5b")
dq = draft_quant_for(cl.head_device.name, _stage_path(cl)) if not a.fp32_draft else "none"
sim = Cluster(base, draft, len(cl.devices) + 1, spec, verify="oracle", size_from_costs=True, draft_quant=dq)
tok = load_tokenizer(base)
prompts = []
for d in a.datasets.split(","):
    prompts += [(p.prompt_id, p.text) for p in load_prompts(d, a.samples)]
costs = cost_model(cl, sim.draft_model.config, draft_quantized=dq != "none",
                   hidden_scale=int(cl.config.hidden_size) / int(sim.config.hidden_size), spec=spec)
print("tree costs", costs.tree)
tot = {}
for i, (pid, text) in enumerate(prompts):
    ids = encode_prompt(tok, text, chat=True)
    ref = None
    for s in a.strategies.split(","):
        t0 = time.time()
        head, stages = sim.build(s, costs)
        res = SimCluster(head, stages, costs).run(i + 1, ids, a.tokens, SamplingParams())
        st = res.done.stats
        n = len(res.done.token_ids)
        if ref is None: ref = res.done.token_ids
        same = res.done.token_ids == ref
        busy = {k: round(v, 2) for k, v in res.trace.busy_fraction().items() if not k.startswith("link")}
        acc = sum(st.accept_lens) / max(1, len(st.accept_lens))
        print(f"{pid:22s} {s:10s} {n/res.sim_time_s:7.3f} tok/s rounds {st.rounds} steps {st.steps} acc {acc:.2f} "
              f"draft_fw {st.draft_forwards} same {same} wall {time.time()-t0:.0f}s cfg d{head.config.tree_depth}/{head.config.tree_nodes}", flush=True)
        print("   busy", busy, "auto", getattr(st, "auto", None) and st.auto.get("final"), flush=True)
        t = tot.setdefault(s, [0, 0.0]); t[0] += n; t[1] += res.sim_time_s
        if a.trace:
            from collections import Counter
            c = Counter()
            for ev in res.trace:
                c[(ev.lane, ev.phase)] += ev.duration_s
            for k, v in sorted(c.items()):
                if not k[0].startswith("link"): print("   ", k, round(v, 3))
    if sim.oracle is not None: sim.oracle.clear()
for s, (n, sec) in tot.items():
    print(f"TOTAL {s:10s} {n/sec:.3f} tok/s")
