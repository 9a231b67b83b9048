"""W4A16 matmul on CPU: flowedge's native kernel (bf16 activations, and int8 activations: W4A8 over the
same tiles) vs torch's int4pack, on the 1.5B model's shapes.

`python tools/bench_w4a16.py --threads 1` (then `--threads 2`; `--kernels native,w4a8` to leave int4pack
out). Prints, per shape and rows M: the best
time of `--repeats` calls (A/B interleaved; each call on the next of several copies of the weight, so
weights come from DRAM as in a decode step), the weight GB/s streamed at M=1 (the bytes each kernel
reads: codes plus its scale/zero table), the cost of M rows over one row; then the per-call overhead
of a tiny layer, and an alternating loop of kernel calls and a threaded torch op (does a kernel call
slow the torch op after it?). Weights are random codes: speed does not depend on their values.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from bench_helpers import COLD_BYTES, bench_parser, best_s, interleaved_times, rotating

from flowedge.kernels import int8act, w4a16
from flowedge.models.quant import PackedInt4, pack_int4, unpack_codes

SHAPES = (  # (name, K, N)
    ("q/o_proj", 1536, 1536), ("k/v_proj", 1536, 256), ("gate/up", 1536, 8960), ("down", 8960, 1536),
    ("lm_head", 1536, 151936),
)
ROWS = (1, 16, 32)
GROUP = 32
CHUNK = 4096


def random_packed(n: int, k: int, g: int = GROUP) -> PackedInt4:
    gen = torch.Generator().manual_seed(n * 7 + k)
    return PackedInt4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                      (torch.rand(n, k // g, generator=gen) * 0.01).bfloat16(),
                      (torch.randn(n, k // g, generator=gen) * 0.01).bfloat16())


def int4pack_fn(w: PackedInt4) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(q), 1)
                        for q in w.qweight.split(CHUNK)])
    sz = torch.stack([w.scales, w.zeros], dim=-1).transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, w.group_size, sz)


KERNELS = ("native", "w4a8", "int4pack")   # native: W4A16 (bf16 activations); w4a8: the same tiles, int8 ones


def bench_shape(name: str, k: int, n: int, repeats: int, kernels: tuple[str, ...] = KERNELS) -> None:
    w = random_packed(n, k)
    gb = n * k * (0.5 + 4 / GROUP) / 1e9   # all read 4-bit codes and two bf16 per group and output
    copies = max(1, int(COLD_BYTES / (gb * 1e9)))
    weights = [w4a16.prepare(w) for _ in range(copies)]
    def make(kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
        if kernel == "int4pack":
            torch_mm = rotating([int4pack_fn(w) for _ in range(copies)])
            return lambda x: torch_mm(x.bfloat16())
        fn = w4a16.linear if kernel == "native" else int8act.linear4
        return rotating([lambda x, wt=wt: fn(x, wt) for wt in weights])

    times = interleaved_times({kernel: make(kernel) for kernel in kernels}, k, n, ROWS, repeats)
    for kernel, ts in times.items():
        cells = "  ".join(f"M={m}: {t * 1e6:8.0f} us" for m, t in zip(ROWS, ts))
        ratios = "  ".join(f"M{m}/M1 {t / ts[0]:5.1f}" for m, t in zip(ROWS[1:], ts[1:]))
        print(f"{name:9s} K={k:5d} N={n:6d} {kernel:8s} {cells}  | M=1 {gb / ts[0]:5.1f} GB/s  {ratios}")


def accuracy() -> None:
    """Relative error against the float32 dequantized reference (x @ W.T), 16 rows, each group size."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1536, generator=gen)
    for g in (32, 64, 128, 256):
        w = pack_int4(torch.randn(1536, 1536, generator=gen) * 0.02, g)
        ref = x @ w.dequantize().T
        tiles = w4a16.prepare(w)
        errs = {label: ((y.float() - ref).norm() / ref.norm()).item() for label, y in
                (("native", w4a16.linear(x, tiles)), ("w4a8", int8act.linear4(x, tiles)),
                 ("int4pack", int4pack_fn(w)(x.bfloat16())))}
        print(f"accuracy G={g:3d}: relative error vs dequantized fp32: " +
              "  ".join(f"{label} {e:.2e}" for label, e in errs.items()))


def bench_overhead(repeats: int) -> None:
    w = random_packed(64, 64)
    native, torch_mm = w4a16.prepare(w), int4pack_fn(w)
    x = torch.randn(1, 64)
    calls = 2000
    for label, fn in (("native", lambda: w4a16.linear(x, native)), ("int4pack", lambda: torch_mm(x.bfloat16()))):
        per = best_s(lambda: [fn() for _ in range(calls)], max(3, repeats // 5)) / calls
        print(f"tiny call (M=1, K=64, N=64) {label:8s} {per * 1e6:6.1f} us")


def bench_alternating(repeats: int) -> None:
    """A decode step alternates kernel calls with torch's own threaded ops: does a kernel call slow the
    torch op after it (a second OpenMP runtime spinning would)? Best of many single pairs, each kernel."""
    w = random_packed(1536, 1536)
    native, torch_mm = w4a16.prepare(w), int4pack_fn(w)
    x, a, dense = torch.randn(1, 1536), torch.randn(16, 1536), torch.randn(1536, 1536)
    torch_op = lambda: torch.softmax(a @ dense, dim=-1)   # noqa: E731
    reps = repeats * 5
    t_op = best_s(torch_op, reps)
    for label, kernel in (("native", lambda: w4a16.linear(x, native)), ("int4pack", lambda: torch_mm(x.bfloat16()))):
        t_kernel = best_s(kernel, reps)
        t_pair = best_s(lambda: (kernel(), torch_op()), reps)
        print(f"alternating {label:8s}: kernel {t_kernel * 1e6:5.0f} us + torch op {t_op * 1e6:5.0f} us alone, "
              f"pair {t_pair * 1e6:5.0f} us ({(t_pair - t_kernel - t_op) * 1e6:+.0f} us)")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated names")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--no-extras", action="store_true", help="the shape table only (no accuracy, overhead)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (w4a16.available() and int8act.available()):
        raise SystemExit("native W4A16 kernels unavailable here (see the log line above)")
    print(f"threads {torch.get_num_threads()}, kernel builds w4a16 {w4a16.isa()}, w4a8 {int8act.isa()}, "
          f"group size {GROUP}")
    wanted, kernels = set(args.shapes.split(",")), tuple(args.kernels.split(","))
    for name, k, n in SHAPES:
        if name in wanted:
            bench_shape(name, k, n, args.repeats, kernels)
    if args.no_extras:
        return
    accuracy()
    bench_overhead(args.repeats)
    bench_alternating(args.repeats)


if __name__ == "__main__":
    main()
