"""Merge the grid's per-kind runs (bench-out/kinds/PHASE/KIND/results.json) into one table per phase.

Phases that ran on a subset of the prompts (oracle, t0b) also carry t0's runs of those prompts, so their
tables compare like with like. Usage: python docs/bench/orin-nano-kinds/merge.py bench-out/kinds docs/bench/orin-nano-kinds
"""
import glob
import json
import os
import sys

from flowedge.bench.report import markdown_table, summarize


def load(src: str, phase: str) -> tuple[dict, list]:
    runs, config = [], None
    for path in sorted(glob.glob(f"{src}/{phase}/*/results.json")):
        with open(path) as f:
            data = json.load(f)
        config = config or data["config"]
        runs += data["runs"]
    return config, runs


def main(src: str, dst: str) -> None:
    _, t0 = load(src, "t0")
    for phase, with_t0 in [("t0", False), ("oracle", True), ("t0b", True), ("t1", False)]:
        config, runs = load(src, phase)
        if not runs:
            continue
        if with_t0:
            ids = {r["prompt_id"] for r in runs}
            runs = [r for r in t0 if r["prompt_id"] in ids] + runs
        config = dict(config, strategies=sorted({r["strategy"] for r in runs}))
        results = {"config": config, "runs": runs, "summary": summarize(runs)}
        os.makedirs(f"{dst}/{phase}", exist_ok=True)
        with open(f"{dst}/{phase}/results.json", "w") as f:
            json.dump(results, f, indent=1)
        with open(f"{dst}/{phase}/table.md", "w") as f:
            f.write(markdown_table(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
