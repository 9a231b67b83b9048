"""A/B decode speed against llama.cpp on the same GGUF: flowedge's one-process strategies (and optionally a
local 3-node cluster) against llama.cpp's prebuilt CPU binary (docs/bench/llamacpp, node-llama-cpp).

    python tools/bench_vs_llamacpp.py [--strategies ar,tree] [--threads 1,2] [--max-new-tokens 128]
        [--dataset humaneval --dataset mt-bench:writing ...] [--samples 1] [--repeats 1] [--cluster]
        [--gguf FILE] [--model NAME] [--out bench-out/vs-llamacpp]

Every timed run is its own process, started one at a time: for each thread count, each repeat and each
prompt, llama.cpp (`node bench.mjs`) then `flowedge generate --strategy S --json` for every S (the order
reversed on odd repeats), so slow drift of a shared box falls on both sides alike. Both decode the same
prompt tokens: flowedge's tokenizer and chat template make them here, llama.cpp gets the ids. The figure
compared is decode tok/s, (new tokens - 1) / (time after the first token): model load and prefill are
excluded on both sides. Peak RSS is each process's own maximum (wait4's ru_maxrss); for the cluster the
sum of its processes' VmHWM. `--cluster` runs `flowedge up --nodes 3` (`--cluster-threads` per process: 1,
the issue's setup, by default; 0 for up's own default, every core) in the
block of the largest thread count and prompts it with `flowedge prompt --json`.

Writes OUT/raw.jsonl (one line per run, token ids included) and OUT/table.md (per prompt kind and overall:
tok/s per side, the ratio to llama.cpp, peak RSS, and the common prefix of each side's greedy tokens with
llama.cpp's).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server_peer import LlamaServer, answer_figures  # noqa: E402
from measured_process import RUN_TIMEOUT_S, last_json, run_measured  # noqa: E402

log = logging.getLogger("bench_vs_llamacpp")

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / "docs" / "bench" / "llamacpp"
LLAMA = "llama.cpp"
CLUSTER = "up-3"
DEFAULT_GGUF = Path.home() / ".cache" / "flowedge" / "gguf" / "qwen2.5-coder-1.5b.gguf"
DEFAULT_DATASETS = ("humaneval", "mt-bench:writing", "mt-bench:math", "mt-bench:extraction")


@dataclass(frozen=True)
class Case:
    """One prompt as both sides see it: the text for flowedge, the templated ids for llama.cpp."""
    prompt_id: str
    kind: str
    text: str
    ids: tuple[int, ...]


@dataclass
class Run:
    """One timed process: which side, on which prompt, and what it measured."""
    side: str
    threads: int
    prompt_id: str
    kind: str
    repeat: int
    new_tokens: int
    decode_s: float | None
    decode_tokens_per_s: float | None
    prefill_s: float | None
    peak_rss_mb: float
    token_ids: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def kind_of(dataset: str) -> str:
    return "code" if dataset == "humaneval" else dataset.partition(":")[2] or dataset


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def decode_rate(new_tokens: int, decode_s: float | None) -> float | None:
    """Tokens after the first per second after the first: the same definition bench.mjs and flowedge use."""
    return (new_tokens - 1) / decode_s if decode_s and new_tokens > 1 else None


# --- running one side ------------------------------------------------------------------------------------

def run_llama(case: Case, gguf: Path, threads: int, max_new: int, repeat: int) -> Run:
    cmd = ["node", str(PEER_DIR / "bench.mjs"), "--model", str(gguf), "--threads", str(threads),
           "--max-new-tokens", str(max_new)]
    stdout, stderr, rss = run_measured(cmd, json.dumps({"id": case.prompt_id, "tokens": list(case.ids)}) + "\n")
    res, info = last_json(stdout), last_json(stderr)
    return Run(LLAMA, threads, case.prompt_id, case.kind, repeat, res["new_tokens"], res["decode_s"],
               res["decode_tokens_per_s"], res["prefill_s"], rss, res["token_ids"],
               {"eos_at": res["eos_at"], "load_s": res["load_s"], "prompt_tokens": res["prompt_tokens"],
                "llama_cpp": {k: info.get(k) for k in ("release", "build", "gpu", "threads", "context_size")}})


def run_flowedge(case: Case, model: str, side: str, threads: int, max_new: int, repeat: int) -> Run:
    """`side` is a strategy, or STRATEGY@ISA to force the kernels' ISA level (FLOWEDGE_ISA: avx2, portable)."""
    strategy, _, isa = side.partition("@")
    cmd = [sys.executable, "-m", "flowedge", "generate", case.text, "--model", model, "--strategy", strategy,
           "--max-new-tokens", str(max_new), "--threads", str(threads), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} | ({"FLOWEDGE_ISA": isa} if isa else {})
    stdout, _, rss = run_measured(cmd, env=env)
    res = last_json(stdout)
    if res["prompt_tokens"] != len(case.ids):
        log.warning("%s: flowedge saw %d prompt tokens, llama.cpp %d", case.prompt_id, res["prompt_tokens"],
                    len(case.ids))
    extra = {k: res[k] for k in ("prompt_tokens", "mean_accept_len", "total_s") if k in res}
    return Run(side, threads, case.prompt_id, case.kind, repeat, res["new_tokens"], res.get("decode_s"),
               res.get("decode_tokens_per_s"), res.get("prefill_s"), rss, res["token_ids"], extra)


class LocalCluster:
    """`flowedge up --nodes 3 --detach` (`threads` per process; 0: up's default, every core) prompted with
    `flowedge prompt --json`."""

    def __init__(self, model: str, port: int, threads: int = 1) -> None:
        self.model, self.port, self.threads = model, port, threads
        self.pids: list[int] = []

    def flowedge(self, *args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "flowedge", *args], capture_output=True, text=True,
                              cwd=ROOT, check=False, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"flowedge {args[0]} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
        return proc.stdout

    def __enter__(self) -> LocalCluster:
        from flowedge.node.node_config import flowedge_home

        self.flowedge("up", "--nodes", "3", "--threads", str(self.threads), "--detach", "--port", str(self.port),
                      "--model", self.model)
        state = json.loads((flowedge_home() / "run" / f"up-{self.port}" / "cluster.json").read_text())
        self.pids = state["pids"]
        self.prompt("Say hi.", 8)   # warm-up, untimed: first-request paths out of the timed runs
        return self

    def __exit__(self, *exc) -> None:
        self.flowedge("down", "--port", str(self.port))

    def prompt(self, text: str, max_new: int) -> dict:
        return last_json(self.flowedge("prompt", text, "--json", "--max-new-tokens", str(max_new),
                                       "--head", f"127.0.0.1:{self.port}"))

    def peak_rss_mb(self) -> float:
        """Sum over the cluster's processes of each one's peak resident memory so far (VmHWM)."""
        total_kb = 0
        for pid in self.pids:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kb += int(line.split()[1])
        return total_kb / 1024

    def run(self, case: Case, max_new: int, repeat: int, block_threads: int) -> Run:
        res = self.prompt(case.text, max_new)
        n, first_s = res["new_tokens"], res.get("first_token_s")
        decode_s = round(res["client_wall_s"] - first_s, 4) if first_s is not None else None
        rate = decode_rate(n, decode_s)
        return Run(CLUSTER, block_threads, case.prompt_id, case.kind, repeat, n, decode_s,
                   round(rate, 3) if rate else None, first_s, self.peak_rss_mb(), res["token_ids"],
                   {"strategy": res.get("strategy"), "threads_per_process": self.threads or "every core",
                    "wall_tokens_per_s": res.get("wall_tokens_per_s")})


# --- prompts and schedule ---------------------------------------------------------------------------------

def load_cases(datasets: list[str], samples: int, model: str) -> list[Case]:
    """The first `samples` prompts of each dataset, tokenized as `flowedge generate` does (chat template)."""
    from flowedge.datasets import load_prompts
    from flowedge.models.resolve import resolve_model
    from flowedge.text.prompts import encode_prompt, load_tokenizer

    tok = load_tokenizer(resolve_model(model, quant="int4"))
    return [Case(p.prompt_id, kind_of(ds), p.text, tuple(encode_prompt(tok, p.text, chat=True)))
            for ds in datasets for p in load_prompts(ds, samples)]


def check_same_weights(model: str, gguf: Path) -> None:
    """flowedge's converted model must come from this very GGUF (its flowedge.json records the sha256)."""
    from flowedge.models.resolve import resolve_model

    meta = json.loads((resolve_model(model, quant="int4") / "flowedge.json").read_text())
    sha_file = gguf.with_name(gguf.name + ".sha256")
    if sha_file.is_file() and meta.get("sha256") != sha_file.read_text().split()[0]:
        raise SystemExit(f"{model} was not converted from {gguf} (sha256 differs): not the same weights")


def schedule(cases: list[Case], sides: list[str], repeats: int) -> list[tuple[int, Case, str]]:
    """(repeat, case, side) in run order: every side on one prompt before the next prompt, the order of the
    sides reversed on odd repeats (A/B, then B/A)."""
    order = []
    for r in range(repeats):
        for case in cases:
            order += [(r, case, side) for side in (sides if r % 2 == 0 else sides[::-1])]
    return order


def run_served(server: LlamaServer, case: Case, max_new: int, repeat: int) -> Run:
    """llama.cpp built from source (`--peer-bin`): one answer from the block's llama-server."""
    got = answer_figures(server.complete(list(case.ids), max_new))
    return Run(LLAMA, server.threads, case.prompt_id, case.kind, repeat, got["new_tokens"], got["decode_s"],
               got["decode_tokens_per_s"], got["prefill_s"], server.peak_rss_mb(), got["token_ids"],
               {"llama_predicted_per_second": got["llama_predicted_per_second"], "build": server.version()})


def run_block(args, cases: list[Case], threads: int, cluster: LocalCluster | None, sink) -> list[Run]:
    sides = [LLAMA, *args.strategies] + ([CLUSTER] if cluster else [])
    runs = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LlamaServer(args.peer_bin, args.gguf, threads)) if args.peer_bin else None
        for repeat, case, side in schedule(cases, sides, args.repeats):
            run = run_side(args, side, case, threads, repeat, cluster, server)
            log.info("threads %d, %s, %s: %s decode tok/s, %d tokens, peak %.0f MB", threads, case.prompt_id,
                     side, run.decode_tokens_per_s, run.new_tokens, run.peak_rss_mb)
            sink.write(json.dumps(asdict(run)) + "\n")
            sink.flush()
            runs.append(run)
    return runs


def run_side(args, side: str, case: Case, threads: int, repeat: int, cluster: LocalCluster | None,
             server: LlamaServer | None) -> Run:
    if side == LLAMA:
        if server is not None:
            return run_served(server, case, args.max_new_tokens, repeat)
        return run_llama(case, args.gguf, threads, args.max_new_tokens, repeat)
    if side == CLUSTER:
        assert cluster is not None
        return cluster.run(case, args.max_new_tokens, repeat, threads)
    return run_flowedge(case, args.model, side, threads, args.max_new_tokens, repeat)


# --- report -----------------------------------------------------------------------------------------------

def pooled_rate(runs: list[Run]) -> float | None:
    """All decoded tokens over all decode time: one slow prompt weighs by its time, as a user feels it."""
    timed = [r for r in runs if r.decode_s and r.new_tokens > 1]
    total_s = sum(r.decode_s for r in timed)
    return sum(r.new_tokens - 1 for r in timed) / total_s if total_s else None


def speed_table(runs: list[Run], sides: list[str], threads: int) -> list[str]:
    per = next((r.extra.get("threads_per_process") for r in runs if r.side == CLUSTER), None)
    rows = [f"### {threads} thread{'s' if threads > 1 else ''}" + (f" (cluster: {per} per process)" if per else ""), "",
            "| kind | " + " | ".join(f"{s} tok/s" for s in sides) + " | " + " | ".join(f"{s} RSS MB" for s in sides)
            + " |", "|---" * (1 + 2 * len(sides)) + "|"]
    by_kind: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_kind[run.kind].append(run)
    for kind, group in [*sorted(by_kind.items()), ("overall", runs)]:
        base = pooled_rate([r for r in group if r.side == LLAMA])
        cells = []
        for side in sides:
            rate = pooled_rate([r for r in group if r.side == side])
            ratio = f" ({rate / base:.2f}×)" if rate and base and side != LLAMA else ""
            cells.append(f"{rate:.2f}{ratio}" if rate else "–")
        rss = [max((r.peak_rss_mb for r in group if r.side == side), default=0) for side in sides]
        label = f"**{kind}**" if kind == "overall" else kind
        rows.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(f"{m:.0f}" for m in rss) + " |")
    return rows + [""]


def prefix_table(runs: list[Run], sides: list[str]) -> list[str]:
    """Per prompt and thread count (first repeat): how many of each side's first tokens equal llama.cpp's."""
    others = [s for s in sides if s != LLAMA]
    rows = ["| threads | prompt | kind | " + " | ".join(others) + " |", "|---" * (3 + len(others)) + "|"]
    first = {(r.threads, r.prompt_id, r.side): r for r in runs if r.repeat == 0}
    for (threads, prompt_id, side), ref in sorted(first.items()):
        if side != LLAMA:
            continue
        cells = []
        for other in others:
            run = first.get((threads, prompt_id, other))
            cells.append(f"{common_prefix(ref.token_ids, run.token_ids)}/{run.new_tokens}" if run else "–")
        rows.append(f"| {threads} | {prompt_id} | {ref.kind} | " + " | ".join(cells) + " |")
    return rows + [""]


def render(runs: list[Run], sides: list[str], header: list[str]) -> str:
    """table.md: the header, a speed and memory table per thread count, the common-prefix table."""
    lines = [*header, "", "## Decode tok/s (ratio to llama.cpp) and peak RSS", ""]
    for threads in sorted({r.threads for r in runs}):
        block = [r for r in runs if r.threads == threads]
        lines += speed_table(block, [s for s in sides if any(r.side == s for r in block)], threads)
    lines += ["## Greedy tokens equal to llama.cpp's (common prefix / new tokens)", "",
              *prefix_table(runs, [s for s in sides if any(r.side == s for r in runs)])]
    return "\n".join(lines)


def box_note() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, load average {load}"


def peer_note(runs: list[Run]) -> str:
    built = next((r.extra["build"] for r in runs if r.side == LLAMA and "build" in r.extra), None)
    if built is not None:
        return f"llama.cpp built from source ({built}), llama-server, one slot, no prompt cache"
    version = json.loads((PEER_DIR / "node_modules" / "node-llama-cpp" / "package.json").read_text())["version"]
    info = next((r.extra["llama_cpp"] for r in runs if r.side == LLAMA), {})
    return (f"llama.cpp {info.get('release')} ({info.get('build')} binary, gpu {info.get('gpu')}) through "
            f"node-llama-cpp {version}, context {info.get('context_size')}")


# --- command line -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="ar,tree",
                    help="flowedge generate strategies, comma-separated; STRATEGY@avx2 forces that ISA level")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dataset", action="append", dest="datasets",
                    help=f"repeatable; default: {' '.join(DEFAULT_DATASETS)}")
    ap.add_argument("--samples", type=int, default=1, help="prompts per dataset")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each side per prompt (A/B, B/A, ...)")
    ap.add_argument("--cluster", action="store_true", help="also `flowedge up --nodes 3` at the largest thread count")
    ap.add_argument("--cluster-port", type=int, default=5755)
    ap.add_argument("--cluster-threads", type=int, default=1,
                    help="threads per cluster process (1: the issue's setup; 0: up's default, every core)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "vs-llamacpp")
    ap.add_argument("--peer-bin", type=Path, help="llama.cpp built from source (tools/llamacpp_build.py "
                    "--print-dir): its llama-server is the peer instead of node-llama-cpp's prebuilt binary")
    args = ap.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.threads = [int(t) for t in args.threads.split(",") if t]
    args.datasets = args.datasets or list(DEFAULT_DATASETS)
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if not args.peer_bin and not (PEER_DIR / "node_modules" / "node-llama-cpp").is_dir():
        raise SystemExit(f"llama.cpp peer not installed: cd {PEER_DIR} && npm ci (see its README.md)")
    check_same_weights(args.model, args.gguf)
    cases = load_cases(args.datasets, args.samples, args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    header = ["# flowedge vs llama.cpp: decode tok/s, same GGUF, greedy", "",
              f"`python tools/bench_vs_llamacpp.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
              f"- {len(cases)} prompts ({', '.join(sorted({c.kind for c in cases}))}), {args.max_new_tokens} new "
              f"tokens, T=0, {args.repeats} repeat(s); GGUF `{args.gguf}`",
              f"- box at start: {box_note()}"]
    if os.getloadavg()[0] > 0.5:
        log.warning("the box is busy (load average %.2f): llama.cpp's threads spin at their barriers and collapse "
                    "when they share cores with other jobs (seen: 0.4 tok/s at 2 threads); compare on a quiet box",
                    os.getloadavg()[0])
    runs: list[Run] = []
    with open(args.out / "raw.jsonl", "w") as sink:
        for threads in args.threads:
            if args.cluster and threads == max(args.threads):
                with LocalCluster(args.model, args.cluster_port, args.cluster_threads) as cluster:
                    runs += run_block(args, cases, threads, cluster, sink)
            else:
                runs += run_block(args, cases, threads, None, sink)
    header += [f"- box at end: {box_note()}", f"- {peer_note(runs)}"]
    sides = [LLAMA, *args.strategies, CLUSTER]
    (args.out / "table.md").write_text(render(runs, sides, header) + "\n")
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
