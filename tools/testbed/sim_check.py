"""The simulator against the testbed: for every (devices, preset) measured in a bench folder's raw.jsonl,
simulate flowedge on the same prompts with the preset's link profile (`flowedge bench --driver sim --link
PRESET`), and write predicted vs measured wall tok/s with the error per case. Needs no root: nothing real runs.

    python -m tools.testbed.sim_check docs/bench/testbed --out /tmp/sim-check [--cases 3:wifi] [--reuse]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tools.testbed.bench import pooled

REPO = Path(__file__).resolve().parents[2]
LIMIT = 0.15   # the error a case may have


def simulate(bench: Path, n: int, preset: str, out: Path, args) -> dict:
    """One case's simulated runs (results.json of `flowedge bench --driver sim`)."""
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c["text"]}) + "\n"
                               for c in json.loads((bench / "cases.json").read_text())))
    folder = out / f"{n}-{preset}"
    if args.reuse and (folder / "results.json").is_file():
        done = json.loads((folder / "results.json").read_text())
        if len(done.get("runs", [])) == len(json.loads((bench / "cases.json").read_text())):
            return done
    subprocess.run([sys.executable, "-m", "flowedge", "bench", "--driver", "sim", "--strategies", "auto",
                    "--prompts", str(prompts), "--nodes", str(n), "--profile", "x86-cpu", "--link", preset,
                    "--max-new-tokens", str(args.max_new_tokens), "--verify", "oracle",
                    "--model", args.model, "--draft", args.draft, "--out", str(folder)],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return json.loads((folder / "results.json").read_text())


def sim_rate(results: dict) -> float:
    """All tokens over all simulated time (prefill included, as flowedge's wall tok/s)."""
    runs = [r for r in results["runs"] if r["strategy"] == "auto"]
    return sum(len(r["token_ids"]) for r in runs) / sum(r["sim_time_s"] for r in runs)


def compare(bench: Path, out: Path, args) -> list[dict]:
    rows = [json.loads(line) for line in (bench / "raw.jsonl").read_text().splitlines() if line.strip()]
    mine = [r for r in rows if r["side"] == "flowedge"]
    cases = []
    for n, preset in sorted({(r["devices"], r["preset"]) for r in mine}):
        if args.cases and f"{n}:{preset}" not in args.cases.split(","):
            continue
        measured = pooled([r for r in mine if (r["devices"], r["preset"]) == (n, preset)], "wall_tokens_per_s")
        predicted = sim_rate(simulate(bench, n, preset, out, args))
        cases.append({"devices": n, "preset": preset, "measured": measured, "predicted": predicted,
                      "error": predicted / measured - 1})
    return cases


def table(cases: list[dict]) -> str:
    lines = ["| devices | preset | measured wall tok/s | simulated | error |", "|---|---|---|---|---|"]
    for c in cases:
        flag = f" (off by more than {LIMIT:.0%})" if abs(c["error"]) > LIMIT else ""
        lines.append(f"| {c['devices']} | {c['preset']} | {c['measured']:.2f} | {c['predicted']:.2f} | "
                     f"{c['error']:+.1%}{flag} |")
    return "\n".join(lines) + "\n"


def link_table(cases: list[dict]) -> str:
    """What each preset adds to a token over `lan` at the same device count, in ms (wall, prefill in): the
    links' own share, free of the compute profile's error and of box load common to a device count."""
    lines = ["| devices | preset | measured +ms/token over lan | simulated | sim - measured |", "|---|---|---|---|---|"]
    lan = {c["devices"]: c for c in cases if c["preset"] == "lan"}
    for c in cases:
        base = lan.get(c["devices"])
        if base is None or c is base:
            continue
        got = 1e3 / c["measured"] - 1e3 / base["measured"]
        sim = 1e3 / c["predicted"] - 1e3 / base["predicted"]
        lines.append(f"| {c['devices']} | {c['preset']} | {got:+.1f} | {sim:+.1f} | {sim - got:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", type=Path, help="a testbed bench folder (raw.jsonl, cases.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--cases", default="", help="only these, e.g. 3:wifi,3:lan (default: every measured one)")
    p.add_argument("--reuse", action="store_true", help="keep a case's finished simulation from an earlier run")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = compare(args.bench, args.out, args)
    (args.out / "sim-check.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(table(cases) + "\n" + link_table(cases), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
