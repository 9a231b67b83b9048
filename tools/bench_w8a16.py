"""W8A16 vs W4A16 matmul on CPU (flowedge's native kernels), on the shapes the real pair keeps at 6-8 bits;
with `--int8` also W8A8 and W4A8 (the same tiles with int8 activations, kernels/int8act.py).

`python tools/bench_w8a16.py --threads 1` (then `--threads 2`). Per shape and rows M: the best time of
`--repeats` calls, the two kernels A/B interleaved, each call on the next of several copies of the weight
(weights come from DRAM as in a decode step), and the weight GB/s streamed at M=1.
"""
from __future__ import annotations

import torch
from bench_helpers import COLD_BYTES, bench_parser, interleaved_times, rotating
from bench_w4a16 import GROUP, random_packed

from flowedge.kernels import int8act, w4a16, w8a16
from flowedge.models.quant8 import PackedInt8

SHAPES = (("v_proj", 1536, 256), ("down", 8960, 1536), ("lm_head", 1536, 151936))   # (name, K, N)
ROWS = (1, 16)


def random_packed8(n: int, k: int) -> PackedInt8:
    gen = torch.Generator().manual_seed(n * 7 + k)
    return PackedInt8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                      torch.rand(n, k // GROUP, generator=gen) * 0.01)


def bench_shape(name: str, k: int, n: int, repeats: int, int8: bool = False) -> None:
    sizes = {"w4a16": n * k * (0.5 + 4 / GROUP), "w8a16": n * k * (1 + 4 / GROUP)}
    copies = {kind: max(1, int(COLD_BYTES / b)) for kind, b in sizes.items()}
    w4 = [w4a16.prepare(random_packed(n, k)) for _ in range(copies["w4a16"])]
    w8 = [w8a16.prepare(random_packed8(n, k)) for _ in range(copies["w8a16"])]
    fns = {"w4a16": rotating([lambda x, w=w: w4a16.linear(x, w) for w in w4]),
           "w8a16": rotating([lambda x, w=w: w8a16.linear(x, w) for w in w8])}
    if int8:
        sizes |= {"w4a8": sizes["w4a16"], "w8a8": sizes["w8a16"]}
        fns |= {"w4a8": rotating([lambda x, w=w: int8act.linear4(x, w) for w in w4]),
                "w8a8": rotating([lambda x, w=w: int8act.linear8(x, w) for w in w8])}
    times = interleaved_times(fns, k, n, ROWS, repeats)
    for kind, ts in times.items():
        cells = "  ".join(f"M={m}: {t * 1e6:8.0f} us" for m, t in zip(ROWS, ts))
        print(f"{name:8s} K={k:5d} N={n:6d} {kind:5s} {cells}  | M=1 {sizes[kind] / ts[0] / 1e9:5.1f} GB/s  "
              f"M16/M1 {ts[1] / ts[0]:4.1f}")


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--int8", action="store_true", help="also the int8-activation kernels (W4A8, W8A8)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (w4a16.available() and w8a16.available()):
        raise SystemExit("native kernels unavailable here (see the log line above)")
    print(f"threads {torch.get_num_threads()}, kernel builds w4a16 {w4a16.isa()}, w8a16 {w8a16.isa()}")
    for name, k, n in SHAPES:
        bench_shape(name, k, n, args.repeats, args.int8)


if __name__ == "__main__":
    main()
