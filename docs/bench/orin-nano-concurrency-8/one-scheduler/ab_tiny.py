"""Old (MultiHead) vs new (Scheduler) simulated figures on the tiny pair, same config."""
import json, sys, tempfile
from pathlib import Path
try:
    from flowedge.engine.scheduler import BatchConfig
except ImportError:
    from flowedge.sim.cluster import BatchConfig
from flowedge.core.sampling import SamplingParams
from flowedge.engine.config import SpecConfig
from flowedge.models.tiny import make_tiny_pair
from flowedge.sim.cluster import SimRequest
from flowedge.sim.run import Cluster

pair = make_tiny_pair(Path(tempfile.mkdtemp()))
SMALL = SpecConfig(tree_nodes=24, tree_depth=4, topk=4, l_max=6, exp_nodes=12, exp_depth=3, se_nodes=4, pipedec_width=4, prefill_chunk=5)
PROMPTS = [list(range(3, 20)), [72, 101, 108, 108, 111, 32, 119], [5] * 9 + [200, 201, 202], [40, 41, 42, 43],
           [9, 8, 7, 6, 5], [100, 101, 102], [11] * 12, [30, 31, 32, 33, 34, 35]]
out = {}
for strategy in ("flowspec", "ar-pp"):
    cluster = Cluster(*pair, 5, SMALL)
    for c in (1, 4):   # the A/B above; (1, 2, 4, 8) for the whole sweep
        reqs = [SimRequest(i + 1, tuple(p), 24, SamplingParams()) for i, p in enumerate(PROMPTS)]
        res = cluster.generate_many(strategy, reqs, BatchConfig(max_concurrent=c), device="orin-nano-8gb")[0]
        toks = sum(len(t.done.token_ids) for t in res.requests.values())
        ttft = sum(t.emits[0][0] - t.arrival_s for t in res.requests.values()) / len(res.requests)
        out[f"{strategy} x{c}"] = (round(toks / res.sim_time_s, 4), round(ttft, 5), [t.done.token_ids for t in res.requests.values()])
json.dump(out, open(sys.argv[1], "w"))
for k, v in out.items():
    print(k, v[:2])
