"""Stage step time of a batched W4A16 forward: several requests' rows through layers [START, END), each
request with 300 cached entries. Runs whichever code is on PYTHONPATH: `forward_packed` (each request
attends over its own cache) or, on a checkout before it, one SDPA with a block-diagonal mask over the
requests' concatenated K/V.

usage: PYTHONPATH=<checkout> python docs/bench/stage-batched-step/run.py MODEL_DIR START END [reps]
"""
import copy, statistics, sys, time
import torch
from flowedge.models.stage import StageModel, StageParts, bool_to_float_mask, causal_mask

torch.set_num_threads(1)
m = StageModel.load(sys.argv[1], parts=StageParts(int(sys.argv[2]), int(sys.argv[3])), quant="int4")
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
H = m.config.hidden_size
new = hasattr(m, "forward_packed")
if not new:
    from flowedge.models.kv_cache import PackedKV
    from flowedge.models.stage import block_diagonal
print("code:", "per-request attention (forward_packed)" if new else "block-diagonal over packed K/V", "| layers", len(m.layers))
g = torch.Generator().manual_seed(0)
PAST = 300
base = m.new_cache(512)
m.forward_layers(torch.randn(PAST, H, generator=g), torch.arange(PAST), bool_to_float_mask(causal_mask(PAST, 0)), base)
for k, rows in [(1, 1), (2, 1), (4, 1), (4, 8), (4, 16)]:
    hid = torch.randn(k * rows, H, generator=g)
    pos = torch.cat([torch.arange(PAST, PAST + rows)] * k)
    allowed = [causal_mask(rows, PAST)] * k
    times = []
    for _ in range(reps):
        caches = [copy.deepcopy(base) for _ in range(k)]
        t0 = time.perf_counter()
        if k == 1:
            m.forward_layers(hid, pos, bool_to_float_mask(allowed[0]), caches[0])
        elif new:
            m.forward_packed(hid, pos, [bool_to_float_mask(a) for a in allowed], caches)
        else:
            m.forward_layers(hid, pos, bool_to_float_mask(block_diagonal(allowed)), PackedKV(caches, [rows] * k))
        times.append(time.perf_counter() - t0)
    print(f"{k} requests x {rows:2d} rows, {PAST} cached each: median {1e3 * statistics.median(times):8.2f} ms "
          f"(min {1e3 * min(times):.2f}) over {reps}")
