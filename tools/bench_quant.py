"""Per-call latency of the quantization backends on Qwen2.5-1.5B-sized Linear layers.

One quick run: `python tools/bench_quant.py [--threads 1] [--repeats 20]`. Prints a table of
milliseconds per forward for each backend at 1 and 16 tokens; the CPU default backend is picked
from these numbers (flowedge.models.quant.default_backend).
"""
from __future__ import annotations

import torch
from bench_helpers import bench_parser, best_s
from torch import nn

from flowedge.models.quant import available_backends, quantize_module

SHAPES = ((1536, 1536), (1536, 8960), (8960, 1536))  # (in, out): q/o_proj, gate/up, down
TOKENS = (1, 16)
VARIANTS = (  # (label, backend, compute dtype, activation dtype, group size)
    ("fp32", "none", torch.float32, torch.float32, 32),
    ("bf16", "none", torch.bfloat16, torch.bfloat16, 32),
    ("nf4 fp32", "nf4", torch.float32, torch.float32, 32),
    ("nf4 bf16", "nf4", torch.bfloat16, torch.bfloat16, 32),
    ("int4 g32", "int4", torch.float32, torch.float32, 32),
    ("int4 g128", "int4", torch.float32, torch.float32, 128),
)


def bench_one(shape, label, backend, compute, act, group, repeats) -> list[float]:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(*shape, bias=False))
    if backend == "none":
        layer = layer.to(compute)
    else:
        quantize_module(layer, backend, compute_dtype=compute, group_size=group)
    out = []
    with torch.inference_mode():
        for n in TOKENS:
            x = torch.randn(n, shape[0]).to(act)
            out.append(best_s(lambda: layer(x), repeats) * 1e3)
    return out


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    torch.set_num_threads(args.threads)
    usable = available_backends("cpu")
    print(f"torch {torch.__version__}, {args.threads} thread(s), cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, backends {usable}")
    print(f"{'shape (in x out)':>18} {'variant':>15} " + " ".join(f"{n:>4} tok ms" for n in TOKENS))
    for shape in SHAPES:
        for label, backend, compute, act, group in VARIANTS:
            if usable[backend] is not None:
                continue
            ms = bench_one(shape, label, backend, compute, act, group, args.repeats)
            print(f"{shape[0]:>8} x {shape[1]:<7} {label:>15} " + " ".join(f"{v:11.3f}" for v in ms))


if __name__ == "__main__":
    main()
