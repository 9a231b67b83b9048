"""What the kernel benchmarks share (bench_w4a16.py, bench_w8a16.py, bench_quant.py): the command line's
common options, the best time of repeated calls, weights rotated so they come from DRAM, and the A/B
interleaved timing of several kernels over rows."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

COLD_BYTES = 96 << 20   # rotate over copies of a weight adding up to 3x this CPU's L3: read from DRAM as in decode


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the options all of them take (--threads, --repeats)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    return p


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def rotating(fns: list[Callable[[torch.Tensor], torch.Tensor]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each call runs the next copy, so a copy is out of the caches when its turn comes again."""
    state = {"i": 0}

    def call(x: torch.Tensor) -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]](x)

    return call


def interleaved_times(calls: dict[str, Callable[[torch.Tensor], torch.Tensor]], k: int, n: int,
                      rows: tuple[int, ...], repeats: int) -> dict[str, list[float]]:
    """Per call and row count M (x [M, k], the weight [n, k]): the best time of `repeats` calls (a quarter
    of them for large products), the calls A/B interleaved three times, best of each."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for m in rows:
        x = torch.randn(m, k)
        reps = max(3, repeats if n * k * m < 64e6 else repeats // 4)
        runs: dict[str, list[float]] = {label: [] for label in calls}
        for _ in range(3):
            for label, call in calls.items():
                runs[label].append(best_s(lambda call=call: call(x), reps))
        for label in calls:
            times[label].append(min(runs[label]))
    return times
