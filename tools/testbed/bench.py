"""`python -m tools.testbed bench`: flowedge against llama.cpp's RPC split on the same testbed, prompts and
token budget, for every device count and link preset asked; and the simulator's prediction for each.

For each (devices, preset) one testbed is built; in it, one side at a time: flowedge (`--strategy`, auto by
default; every answer checked against `flowedge generate --strategy ar`), llama-server --rpc, and
llama-server --rpc -md (speculation with the draft on device 0). Writes OUT/raw.jsonl (one line per prompt
and side), OUT/sim.jsonl (`flowedge bench --driver sim` with the preset's link profile) and OUT/table.md.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from tools.bench_vs_llamacpp import common_prefix
from tools.testbed import bed as bedmod
from tools.testbed import sides
from tools.testbed.presets import load_preset, sim_link
from tools.testbed.relay import LinkShape

log = logging.getLogger("testbed.bench")

REPO = bedmod.REPO
SIDES = ("flowedge", "llama", "llama-md")
DATASETS = ("humaneval", "mt-bench:writing", "mt-bench:math", "mt-bench:extraction")


def add_bench_options(p) -> None:
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {list(SIDES)}")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--samples", type=int, default=1, help="prompts per kind")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--llama-bin", default=None, help="folder with llama-server and ggml-rpc-server "
                   "(default: the newest native build of tools/llamacpp_build.py)")
    p.add_argument("--llama-draft-max", type=int, default=None,
                   help="llama-md: --spec-draft-n-max (default: llama.cpp's own)")
    p.add_argument("--sim", action="store_true", help="also the simulator's prediction per (devices, preset)")
    p.add_argument("--out", default="bench-out/testbed")


def load_cases(model: str, samples: int) -> list[dict]:
    sys.path.insert(0, str(REPO / "tools"))
    from bench_vs_llamacpp import load_cases as tokenized

    return [{"prompt_id": c.prompt_id, "kind": c.kind, "text": c.text, "ids": list(c.ids)}
            for c in tokenized(list(DATASETS), samples, model)]


def reference(cases: list[dict], model: str, max_new: int, out: Path) -> dict[str, list[int]]:
    """`flowedge generate --strategy ar` token ids per prompt (cached in OUT/reference.json)."""
    path = out / "reference.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    for case in cases:
        key = f"{model}|{max_new}|{case['prompt_id']}"
        if key not in known:
            res = subprocess.run([sys.executable, "-m", "flowedge", "generate", case["text"], "--model", model,
                                  "--strategy", "ar", "--max-new-tokens", str(max_new), "--json"],
                                 capture_output=True, text=True, check=True, cwd=REPO)
            known[key] = json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]
            path.write_text(json.dumps(known))
    return {c["prompt_id"]: known[f"{model}|{max_new}|{c['prompt_id']}"] for c in cases}


def llama_bin(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    sys.path.insert(0, str(REPO / "tools"))
    from llamacpp_build import find_build

    found = find_build("native")
    if found is None:
        raise SystemExit("no llama.cpp build: run tools/llamacpp_build.py first, or give --llama-bin")
    return found


def run_side(bed: bedmod.Testbed, side: str, args, cases_file: Path, link: LinkShape) -> list[dict]:
    """Start one side with the links unimpaired (llama.cpp ships its weights over RPC at load, flowedge's
    stages read theirs from disk: loading is not what is measured), impair them, prompt, stop."""
    from flowedge.models.registry import gguf_path

    bed.set_link(LinkShape())
    if side == "flowedge":
        procs = sides.start_flowedge(bed, sides.FlowedgeSetup(args.model, args.draft, args.strategy))
    else:
        draft = gguf_path(args.draft) if side == "llama-md" else None
        procs = sides.start_llama(bed, sides.LlamaSetup(llama_bin(args.llama_bin), gguf_path(args.model), draft,
                                                        args.llama_draft_max))
    try:
        bed.set_link(link)
        if side == "flowedge":
            return sides.flowedge_prompts(bed, cases_file, args.max_new_tokens, args.strategy)
        return sides.llama_prompts(bed, cases_file, args.max_new_tokens)
    finally:
        sides.stop(bed, procs)


def run_bench(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = load_cases(args.model, args.samples)
    cases_file = out / "cases.json"
    cases_file.write_text(json.dumps(cases))
    ref = reference(cases, args.model, args.max_new_tokens, out)
    wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
    with open(out / "raw.jsonl", "a") as raw:
        for n in (int(x) for x in args.devices.split(",")):
            for preset in (p.strip() for p in args.presets.split(",")):
                spec = bedmod.TestbedSpec(devices=n, link=load_preset(preset), cpus=args.cpus,
                                          memory_mb=args.memory_mb)
                with bedmod.Testbed(spec, out / "logs" / f"{n}-{preset}") as bed:
                    for side in wanted:
                        log.warning("devices %d, preset %s: %s", n, preset, side)
                        for row in run_side(bed, side, args, cases_file, spec.link):
                            row.update(devices=n, preset=preset, side=side, cpus=args.cpus)
                            row["same_as_ar"] = row["token_ids"] == ref[row["prompt_id"]]
                            row["prefix_with_ar"] = common_prefix(row["token_ids"], ref[row["prompt_id"]])
                            raw.write(json.dumps(row) + "\n")
                            raw.flush()
                if args.sim:
                    simulate(args, n, preset, out)
    (out / "table.md").write_text(table(out, args.strategy))
    print((out / "table.md").read_text())
    return 0


def simulate(args, n: int, preset: str, out: Path) -> None:
    """The simulator's decode tok/s for (n, preset): `flowedge bench --driver sim` on the same prompts."""
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c["text"]}) + "\n"
                               for c in json.loads((out / "cases.json").read_text())))
    sim_out = out / "sim" / f"{n}-{preset}"
    subprocess.run([sys.executable, "-m", "flowedge", "bench", "--driver", "sim", "--strategies", args.strategy,
                    "--prompts", str(prompts), "--nodes", str(n), "--profile", "x86-cpu", "--link",
                    sim_link(preset), "--max-new-tokens", str(args.max_new_tokens), "--verify", "oracle",
                    "--model", args.model, "--draft", args.draft, "--out", str(sim_out)],
                   check=True, cwd=REPO, capture_output=True, text=True)
    with open(out / "sim.jsonl", "a") as f:
        f.write(json.dumps({"devices": n, "preset": preset, "results": json.loads(
            (sim_out / "results.json").read_text())}) + "\n")


def pooled(rows: list[dict], key: str) -> float | None:
    """All the rows' tokens over all their time, at each row's `key` rate (a short answer weighs little)."""
    rows = [r for r in rows if r.get(key) and r.get("new_tokens")]
    return sum(r["new_tokens"] for r in rows) / sum(r["new_tokens"] / r[key] for r in rows) if rows else None


def sim_rates(out: Path, strategy: str) -> dict[tuple[int, str], float]:
    """The simulator's tok/s per (devices, preset): all tokens over all simulated time (prefill included)."""
    path, rates = out / "sim.jsonl", {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        entry = json.loads(line)
        runs = [r for r in entry["results"]["runs"] if r["strategy"] == strategy]
        rates[(entry["devices"], entry["preset"])] = (sum(len(r["token_ids"]) for r in runs) /
                                                      sum(r["sim_time_s"] for r in runs))
    return rates


def _cell(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def table(out: Path, strategy: str = "auto") -> str:
    """Decode tok/s per side (prefill and first token left out) with flowedge's ratio to the better llama.cpp
    side; then flowedge's wall tok/s (prefill in) against the simulator's prediction."""
    rows = [json.loads(line) for line in (out / "raw.jsonl").read_text().splitlines() if line.strip()]
    keys = sorted({(r["devices"], r["preset"]) for r in rows})
    pick = lambda n, p, s: [r for r in rows if (r["devices"], r["preset"], r["side"]) == (n, p, s)]  # noqa: E731
    lines = ["| devices | preset | flowedge tok/s | llama.cpp RPC | llama.cpp RPC -md | flowedge / best llama.cpp "
             "| flowedge == ar |", "|---|---|---|---|---|---|---|"]
    for n, preset in keys:
        got = {s: pooled(pick(n, preset, s), "decode_tokens_per_s") for s in SIDES}
        best = max([v for k, v in got.items() if k != "flowedge" and v] or [0])
        same = [r["same_as_ar"] for r in pick(n, preset, "flowedge")]
        ratio = got["flowedge"] / best if got["flowedge"] and best else None
        lines.append(f"| {n} | {preset} | {_cell(got['flowedge'])} | {_cell(got['llama'])} | "
                     f"{_cell(got['llama-md'])} | {_cell(ratio)} | {sum(same)}/{len(same)} |")
    sims = sim_rates(out, strategy)
    if sims:
        lines += ["", "| devices | preset | flowedge wall tok/s | simulator | sim / measured |",
                  "|---|---|---|---|---|"]
        for n, preset in keys:
            wall, sim = pooled(pick(n, preset, "flowedge"), "wall_tokens_per_s"), sims.get((n, preset))
            off = f"{sim / wall:.2f}" + (" (off > 15%)" if abs(sim / wall - 1) > 0.15 else "") if wall and sim else "-"
            lines.append(f"| {n} | {preset} | {_cell(wall)} | {_cell(sim)} | {off} |")
    return "\n".join(lines) + "\n"
