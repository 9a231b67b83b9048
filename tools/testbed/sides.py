"""What runs on the testbed's devices: a flowedge cluster (head on device 0, one stage per other device) or
llama.cpp's RPC split (llama-server on device 0 over one ggml-rpc-server per other device), each prompted
from device 0 by client.py. Both reach the other devices only at their relayed (virtual) addresses."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.testbed.bed import Testbed, terminate

log = logging.getLogger("testbed.sides")

HEAD_PORT = 5555
DATA_PORT = 5600
RPC_PORT = 50052
HTTP_PORT = 8080
READY_TIMEOUT_S = 900.0
PROMPTS_TIMEOUT_S = 7200.0


@dataclass(frozen=True)
class FlowedgeSetup:
    model: str
    draft: str
    strategy: str = "auto"
    device: str = "x86-cpu"
    context: int = 4096


@dataclass(frozen=True)
class LlamaSetup:
    bin_dir: Path
    target_gguf: Path
    draft_gguf: Path | None = None     # -md: speculative decoding with this draft on device 0
    draft_max: int | None = None      # --spec-draft-n-max; None: llama.cpp's default
    context: int = 4096


def _stop(bed: Testbed, procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):   # the server before the RPC servers it uses
        terminate(p, grace_s=10.0)
        if p in bed.procs:
            bed.procs.remove(p)


def _client(bed: Testbed, *args: str, timeout_s: float) -> list[dict]:
    out = bed.run(0, [sys.executable, "-m", "tools.testbed.client", *args], timeout_s).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# --- flowedge ---------------------------------------------------------------------------------------------

def head_toml(bed: Testbed, setup: FlowedgeSetup) -> Path:
    path = bed.log_dir / "head.toml"
    path.write_text("\n".join([
        'role = "head"', f'head = "{bed.local_addr(0)}:{HEAD_PORT}"', 'node_id = "head"',
        f"threads = {bed.spec.threads}", f'model = "{setup.model}"', f'draft = "{setup.draft}"',
        f"stages = {bed.spec.devices - 1}", f'strategy = "{setup.strategy}"', f'device = "{setup.device}"',
        f"context = {setup.context}", "insecure = true", "discovery = false",
    ]) + "\n")
    return path


def start_flowedge(bed: Testbed, setup: FlowedgeSetup) -> list[subprocess.Popen]:
    """The head on device 0 and stage k on device k, stages joining through the relay; returns once ready."""
    if bed.spec.devices < 2:
        raise SystemExit("a flowedge cluster needs at least 2 devices (head + 1 stage)")
    threads = str(bed.spec.threads)
    env = bed.env(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OMP_WAIT_POLICY="passive")
    base = [sys.executable, "-m", "flowedge", "-v"]
    procs = [bed.spawn(0, base + ["serve", "--config", str(head_toml(bed, setup))], "flowedge-head", env)]
    for k in range(1, bed.spec.devices):
        procs.append(bed.spawn(k, base + [
            "join", f"{bed.addr(0)}:{HEAD_PORT}", "--node-id", f"stage-{k}", "--stage", str(k),
            "--threads", threads, "--device", setup.device, "--same-host", "--insecure",
            "--data-port", str(DATA_PORT), "--advertise", bed.addr(k)], f"flowedge-stage-{k}", env))
    try:
        _client(bed, "flowedge-ready", f"{bed.local_addr(0)}:{HEAD_PORT}", str(READY_TIMEOUT_S),
                timeout_s=READY_TIMEOUT_S + 30)
    except BaseException:
        _stop(bed, procs)
        raise
    return procs


def flowedge_prompts(bed: Testbed, cases_file: Path, max_new: int, strategy: str) -> list[dict]:
    return _client(bed, "flowedge", f"{bed.local_addr(0)}:{HEAD_PORT}", str(cases_file), str(max_new), strategy,
                   timeout_s=PROMPTS_TIMEOUT_S)


def stop(bed: Testbed, procs: list[subprocess.Popen]) -> None:
    _stop(bed, procs)


# --- llama.cpp --------------------------------------------------------------------------------------------

def start_llama(bed: Testbed, setup: LlamaSetup) -> list[subprocess.Popen]:
    """ggml-rpc-server on devices 1..N-1, llama-server on device 0 with every layer on them; returns once
    the server answers /health. The RPC servers cache tensors on disk (-c), so only the first load of a
    model crosses the impaired links in full."""
    threads = str(bed.spec.threads)
    env = bed.env(LLAMA_CACHE=str(bed.log_dir.parent / "llama-cache"))
    procs = [bed.spawn(k, [str(setup.bin_dir / "ggml-rpc-server"), "-H", bed.local_addr(k), "-p", str(RPC_PORT),
                           "-t", threads, "-c"], f"rpc-{k}", env) for k in range(1, bed.spec.devices)]
    rpc = ",".join(f"{bed.addr(k)}:{RPC_PORT}" for k in range(1, bed.spec.devices))
    cmd = [str(setup.bin_dir / "llama-server"), "-m", str(setup.target_gguf), "--host", bed.local_addr(0),
           "--port", str(HTTP_PORT), "-t", threads, "-c", str(setup.context), "-np", "1", "--no-webui"]
    if rpc:
        cmd += ["--rpc", rpc, "-ngl", "99"]
    if setup.draft_gguf is not None:   # a plain GGUF draft names no type: without --spec-type nothing is drafted
        cmd += ["-md", str(setup.draft_gguf), "-ngld", "0", "--spec-type", "draft-simple"]
        cmd += ["--spec-draft-n-max", str(setup.draft_max)] if setup.draft_max else []
    procs.append(bed.spawn(0, cmd, "llama-server" + ("-md" if setup.draft_gguf else ""), env))
    try:
        _client(bed, "llama-ready", f"http://{bed.local_addr(0)}:{HTTP_PORT}", str(READY_TIMEOUT_S),
                timeout_s=READY_TIMEOUT_S + 30)
    except BaseException:
        _stop(bed, procs)
        raise
    return procs


def llama_prompts(bed: Testbed, cases_file: Path, max_new: int) -> list[dict]:
    return _client(bed, "llama", f"http://{bed.local_addr(0)}:{HTTP_PORT}", str(cases_file), str(max_new),
                   timeout_s=PROMPTS_TIMEOUT_S)
